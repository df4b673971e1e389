"""The load generator: send a ``Workload`` over httpx, streaming, and record one ``Sample`` per request.

Streaming is what makes TTFT real: the clock stops at the first server-sent event that carries a token,
not when the whole body has arrived. Usage (prompt, completion and cached tokens) comes from the final
event (``stream_options.include_usage``); which instance served comes from ``x-taogate-instance``.

With one ``Target`` every request goes there (the gateway). With several, requests go round robin
over them, each with its own key: the baseline without a gateway ("no unified channel").

Bounded twice: at most ``max_requests`` are sent, and at ``max_seconds`` the run stops launching,
cancels what is still in flight and records those as errors. Nothing here retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from taogate.bench.workloads import RequestSpec, Workload

__all__ = ["Run", "Sample", "Target", "run_load"]

INSTANCE_HEADER = "x-taogate-instance"
_ERROR_CHARS = 200


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: an OpenAI API base (ending in ``/v1``) and its key."""

    api_base: str
    key: str
    name: str | None = None  # fixed instance label (direct mode); else read from the response header


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's outcome. Times are seconds since the run started."""

    index: int
    group: str
    start: float
    end: float
    ttft: float | None
    status: int  # HTTP status; 0 when no response (connect error, timeout, cancelled at the cap)
    instance: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None


@dataclass(slots=True)
class Run:
    """All samples of one run, in completion order, plus its wall-clock frame."""

    label: str
    samples: list[Sample] = field(default_factory=list)
    started_at: float = 0.0  # epoch seconds (to line up with server logs)
    duration: float = 0.0
    stopped_early: bool = False


def _loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in {"127.0.0.1", "localhost", "::1"}


def request_body(spec: RequestSpec, model: str, temperature: float = 0.0) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one spec: chat when it has a system prompt, completions otherwise."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.system is None:
        body["prompt"] = spec.prompt
        return "/completions", body
    body["messages"] = [{"role": "system", "content": spec.system}, {"role": "user", "content": spec.prompt}]
    return "/chat/completions", body


def _has_token(event: Mapping[str, Any]) -> bool:
    """The event brings the first token: text, or the end of the answer. A token can carry no text
    (a character split over two byte-level tokens), and when it is the only one (``max_tokens``
    1) the event that ends the answer is the one that brought it."""
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return True
    return False


def _error_text(raw: bytes) -> str:
    try:
        data = orjson.loads(raw)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        message = raw.decode("utf-8", "replace")
    return str(message)[:_ERROR_CHARS]


async def _one(client: httpx.AsyncClient, target: Target, spec: RequestSpec, model: str, t0: float) -> Sample:
    path, body = request_body(spec, model)
    start = time.perf_counter() - t0
    ttft: float | None = None
    status, instance, error = 0, target.name, None
    usage: Mapping[str, Any] = {}
    try:
        async with client.stream("POST", target.api_base + path, json=body) as response:
            status = response.status_code
            instance = target.name or response.headers.get(INSTANCE_HEADER)
            if status >= 400:
                error = _error_text(await response.aread())
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = orjson.loads(data)
                    if ttft is None and _has_token(event):
                        ttft = time.perf_counter() - t0 - start
                    if event.get("usage"):
                        usage = event["usage"]
                    if isinstance(event.get("error"), dict):  # an error reported mid-stream
                        error = _error_text(data.encode())
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    except orjson.JSONDecodeError:
        error = "malformed server-sent event"
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        index=spec.index,
        group=spec.group,
        start=start,
        end=time.perf_counter() - t0,
        ttft=ttft,
        status=status,
        instance=instance,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        error=error,
    )


async def run_load(
    targets: Sequence[Target],
    workload: Workload,
    model: str,
    *,
    label: str = "",
    headers: Mapping[str, str] | None = None,
    http_timeout: httpx.Timeout | None = None,
    max_requests: int | None = None,
    max_seconds: float = 300.0,
    on_sample: Callable[[Sample], None] | None = None,
) -> Run:
    """Send the workload and return every request's sample (cancelled ones included)."""
    if not targets:
        raise ValueError("run_load needs at least one target")
    work = workload.limited(max_requests)
    run = Run(label or workload.name, started_at=time.time())
    slots = asyncio.Semaphore(work.concurrency)
    limits = httpx.Limits(max_connections=work.concurrency, max_keepalive_connections=work.concurrency)
    timeout = http_timeout or httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=None)
    clients = [
        httpx.AsyncClient(
            headers={**(headers or {}), **({"authorization": f"Bearer {t.key}"} if t.key else {})},
            timeout=timeout,
            limits=limits,
            trust_env=not _loopback(t.api_base),  # a proxy from the environment must not see loopback
        )
        for t in targets
    ]
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    pending: dict[asyncio.Task[Sample], RequestSpec] = {}

    def finished(task: asyncio.Task[Sample]) -> None:
        slots.release()
        spec = pending.pop(task)
        now = time.perf_counter() - t0
        if task.cancelled():
            sample = Sample(spec.index, spec.group, now, now, None, 0, error="cancelled at the duration cap")
        elif (exc := task.exception()) is not None:  # a bug or an odd reply: keep the sample, say why
            sample = Sample(spec.index, spec.group, now, now, None, 0, error=f"{type(exc).__name__}: {exc}")
        else:
            sample = task.result()
        run.samples.append(sample)
        if on_sample is not None:
            on_sample(sample)

    async def launch() -> None:
        for spec in work.requests:
            if spec.at is not None:
                await asyncio.sleep(max(0.0, t0 + spec.at - time.perf_counter()))
            await slots.acquire()
            k = spec.index % len(targets)
            task = asyncio.create_task(_one(clients[k], targets[k], spec, model, t0))
            pending[task] = spec
            task.add_done_callback(finished)

    try:
        launcher = asyncio.create_task(launch())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(launcher), max(0.0, deadline - time.perf_counter()))
        if not launcher.done():
            run.stopped_early = True
            launcher.cancel()
            await asyncio.gather(launcher, return_exceptions=True)
        if pending:
            _, late = await asyncio.wait(set(pending), timeout=max(0.0, deadline - time.perf_counter()))
            if late:
                run.stopped_early = True
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
    finally:
        for client in clients:
            await client.aclose()
    run.duration = time.perf_counter() - t0
    return run
