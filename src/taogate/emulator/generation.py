"""The generation endpoints (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``).

Path of one request: read body → parse (400/404 on bad input) → faults (500 / hang / slow first byte)
→ engine (or ``instant`` mode: answer at once) → respond, streaming or not. The client leaving at any
point aborts the engine request and frees its slot, as vLLM does; so does a stop word (finish reason
``stop``; the emulator matches stop strings against whole generated words) or the
``close_mid_stream`` fault, which raises ``MidStreamClose`` so the server drops the connection
mid-body and the client sees a broken, not a clean, end.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from taogate.emulator.asgi import header, read_body, send_bytes, start_stream, watch_disconnect
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.driver import Tracked
from taogate.emulator.engine import FinishReason
from taogate.emulator.errors import ApiError
from taogate.emulator.instance import EmulatorInstance
from taogate.emulator.protocol import GenerationRequest, parse_embedding, parse_json, require_json
from taogate.emulator.responses import (
    DONE,
    Response,
    embedding_body,
    load_metrics_header,
    stream_usage,
    usage,
)
from taogate.emulator.stats import RequestRecord
from taogate.emulator.tokenizer import Tokenizer

__all__ = ["MidStreamClose", "Parser", "handle_embeddings", "handle_generation"]


class MidStreamClose(Exception):
    """Raised inside the ASGI app to make the server drop the connection mid-stream (a fault)."""


Parser = Callable[[dict[str, Any], Tokenizer, EmulatorConfig], GenerationRequest]


@dataclass(slots=True)
class _Exchange:
    """One HTTP exchange: the instance, the ASGI channels, the record and the response headers."""

    inst: EmulatorInstance
    receive: Receive
    send: Send
    record: RequestRecord
    headers: list[tuple[bytes, bytes]]
    load_format: str | None = None  # endpoint-load-metrics-format asked for (non-stream answers)

    async def error(self, err: ApiError) -> None:
        self.record.status = err.status
        self.record.finish_reason = "error"
        await send_bytes(self.send, err.status, err.body(), headers=self.headers)

    async def json(self, payload: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await send_bytes(self.send, 200, orjson.dumps(payload), headers=[*self.headers, *(extra or ())])


async def _begin(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send, kind: str) -> _Exchange:
    """The request's record; its id is the client's ``X-Request-Id`` or 16 fresh hex digits (the body
    ids' suffix, as in vLLM). Only with ``enable_request_id_headers`` does the answer carry an
    ``x-request-id`` header: the client's, or a fresh uuid that is not the body id (vLLM's habit)."""
    client_id = header(scope, b"x-request-id")
    record = inst.begin(client_id or uuid.uuid4().hex[:16], header(scope, b"x-request-tag"), kind)
    headers = []
    if inst.config.enable_request_id_headers:
        headers.append((b"x-request-id", (client_id or uuid.uuid4().hex).encode("latin-1")))
    return _Exchange(inst, receive, send, record, headers)


async def _pre_engine_faults(ex: _Exchange) -> bool:
    """Apply error/hang/slow-first-byte faults; ``False`` if the client left (nothing to send)."""
    inst, faults = ex.inst, ex.inst.faults
    if faults.error_rate > 0 and inst.rng.random() < faults.error_rate:
        raise ApiError(500, "emulated internal server error (fault injection: error_rate)")
    if faults.hang or faults.slow_first_byte > 0:
        gone = asyncio.Event()
        async with watch_disconnect(ex.receive, gone.set) as watcher:
            # Hang until the client gives up (or the instance shuts down); or sleep the extra delay.
            held = inst.closing.wait() if faults.hang else inst.clock.sleep(faults.slow_first_byte)
            holder = asyncio.ensure_future(held)
            try:
                await asyncio.wait({holder, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                holder.cancel()
        if gone.is_set():
            ex.record.finish_reason = "abort"
            return False
        if inst.closing.is_set():
            raise ApiError(503, "emulator is shutting down")
    return True


async def handle_generation(
    inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send, *, parser: Parser, kind: str
) -> None:
    ex = await _begin(inst, scope, receive, send, kind)
    ex.load_format = header(scope, b"endpoint-load-metrics-format")
    try:
        body = await read_body(receive)
        if body is None:
            ex.record.finish_reason = "abort"
            return
        try:
            require_json(header(scope, b"content-type"))
            req = parser(parse_json(body), inst.tokenizer, inst.config)
            ex.record.prompt_tokens = len(req.prompt_ids)
            if not await _pre_engine_faults(ex):
                return
        except ApiError as err:
            await ex.error(err)
            return
        response = Response(req.kind, ex.record.id, req.model, int(inst.clock.now()))
        load_format = None if req.stream else header(scope, b"endpoint-load-metrics-format")
        if inst.config.instant:
            await _instant(ex, req, response, load_format)
        else:
            await _Generation(ex, req, response, load_format).run()
    finally:
        inst.end(ex.record)


async def _instant(ex: _Exchange, req: GenerationRequest, resp: Response, load_format: str | None) -> None:
    """Engine bypassed (gateway-overhead benchmarks): same shapes, no modelled time."""
    record = ex.record
    details = ex.inst.config.enable_prompt_tokens_details
    words = [" " + Tokenizer.generated_word(req.prompt_ids, i) for i in range(req.max_tokens)]
    record.first_token = ex.inst.clock.now()
    record.completion_tokens = len(words)
    record.finish_reason = "length"
    prompt = len(req.prompt_ids)
    if not req.stream:
        body = resp.full("".join(words), "length", usage(prompt, len(words), 0, details=details))
        await ex.json(body, _load_header(ex, load_format))
        return
    parts = [resp.role_chunk()] if req.kind == "chat" else []
    last = len(words) - 1
    for i, w in enumerate(words):
        running = stream_usage(prompt, i + 1, 0, details=details) if req.continuous_usage else None
        parts.append(
            resp.chunk(
                w,
                "length" if i == last else None,
                fingerprint=i == last and not req.include_usage,
                usage_=running,
            )
        )
    if req.include_usage:
        parts.append(resp.usage_chunk(stream_usage(prompt, len(words), 0, details=details)))
    parts.append(DONE)
    await start_stream(ex.send, ex.headers)
    await ex.send({"type": "http.response.body", "body": b"".join(parts)})


def _load_header(ex: _Exchange, load_format: str | None) -> list[tuple[bytes, bytes]]:
    if load_format is None:
        return []
    engine = ex.inst.engine
    return load_metrics_header(load_format, engine.reported_waiting, engine.kv_usage)


class _Generation:
    """A completion or chat request served by the engine, streamed or collected."""

    def __init__(
        self, ex: _Exchange, req: GenerationRequest, resp: Response, load_format: str | None
    ) -> None:
        self.ex = ex
        self.req = req
        self.resp = resp
        self.load_format = load_format
        self.tracked = Tracked(ex.inst.new_engine_id(ex.record.id), req.prompt_ids, req.max_tokens, ex.record)

    async def run(self) -> None:
        driver, engine_id = self.ex.inst.driver, self.tracked.engine_id
        try:
            driver.submit(self.tracked)
        except ValueError as err:  # e.g. larger than the whole KV cache
            await self.ex.error(ApiError(400, str(err)))
            return
        except RuntimeError as err:  # shutting down
            await self.ex.error(ApiError(503, str(err)))
            return
        # Any way out (client gone mid-write: OSError; send failed; fault raised) frees the engine slot.
        with contextlib.suppress(OSError):
            try:
                async with watch_disconnect(self.ex.receive, self._abort):
                    await (self._stream() if self.req.stream else self._full())
            finally:
                driver.abort(engine_id)

    def _abort(self, reason: FinishReason = "abort") -> None:
        self.ex.inst.driver.abort(self.tracked.engine_id, reason)

    async def _next_text(self) -> tuple[str, str | None]:
        """Wait for the next engine output: (text delta, finish reason), applying stop words."""
        out = await self.tracked.queue.get()
        if out.index is None:
            return "", out.finish_reason
        word = Tokenizer.generated_word(self.req.prompt_ids, out.index)
        if word in self.req.stop and out.finish_reason is None:
            self._abort("stop")  # the finish (reason "stop") follows on the queue; the word is not shown
            return "", None
        return " " + word, out.finish_reason

    def _usage(self, *, streamed: bool = False) -> dict[str, Any]:
        r = self.ex.record
        details = self.ex.inst.config.enable_prompt_tokens_details
        build = stream_usage if streamed else usage
        return build(r.prompt_tokens, r.completion_tokens, r.cached_tokens, details=details)

    async def _full(self) -> None:
        parts: list[str] = []
        while True:  # bounded: the engine finishes every request within max_tokens steps, or aborts it
            text, reason = await self._next_text()
            parts.append(text)
            if reason is not None:
                break
        if reason != "abort":  # after an abort the client is gone; nobody to answer
            body = self.resp.full("".join(parts), reason, self._usage())
            await self.ex.json(body, _load_header(self.ex, self.load_format))

    async def _stream(self) -> None:
        ex, resp = self.ex, self.resp
        close_after = ex.inst.faults.close_mid_stream
        await start_stream(ex.send, ex.headers)
        sent = 0
        while True:  # bounded like _full
            text, reason = await self._next_text()
            if reason == "abort":
                return
            if not text and reason is None:
                continue  # a stop word was swallowed; its finish follows
            req = self.req
            running = self._usage(streamed=True) if req.continuous_usage else None
            parts = [resp.role_chunk(running)] if req.kind == "chat" and sent == 0 else []
            last = reason is not None
            parts.append(resp.chunk(text, reason, fingerprint=last and not req.include_usage, usage_=running))
            if last:
                if req.include_usage:
                    parts.append(resp.usage_chunk(self._usage(streamed=True)))
                parts.append(DONE)
            await ex.send(
                {"type": "http.response.body", "body": b"".join(parts), "more_body": reason is None}
            )
            sent += 1
            if reason is not None:
                return
            if close_after and sent >= close_after:
                raise MidStreamClose(f"fault close_mid_stream: dropping the connection after {sent} chunk(s)")


async def handle_embeddings(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    """Embeddings run through the engine as prefill-only requests (``max_tokens = 0``), so they cost
    prefill time and occupy slots like vLLM's pooling requests; one engine request per input."""
    ex = await _begin(inst, scope, receive, send, "embedding")
    record = ex.record
    try:
        body = await read_body(receive)
        if body is None:
            record.finish_reason = "abort"
            return
        try:
            require_json(header(scope, b"content-type"))
            req = parse_embedding(parse_json(body), inst.tokenizer, inst.config)
            record.prompt_tokens = sum(len(ids) for ids in req.inputs)
            if not await _pre_engine_faults(ex):
                return
            if not inst.config.instant and not await _embed_in_engine(ex, req.inputs):
                return
        except ApiError as err:
            await ex.error(err)
            return
        record.finish_reason = "stop"
        await ex.json(
            embedding_body(
                record.id,
                req.model,
                int(inst.clock.now()),
                req.inputs,
                dim=inst.config.embedding_dim,
                as_base64=req.base64,
            )
        )
    finally:
        inst.end(record)


async def _embed_in_engine(ex: _Exchange, inputs: list[list[int]]) -> bool:
    """Run every input through prefill; ``False`` if the client left (everything is aborted)."""
    driver = ex.inst.driver
    tracked = [Tracked(ex.inst.new_engine_id(ex.record.id), ids, 0, ex.record) for ids in inputs]
    submitted: list[Tracked] = []

    def abort_all() -> None:
        for t in submitted:
            driver.abort(t.engine_id)

    try:
        for t in tracked:
            driver.submit(t)
            submitted.append(t)
        async with watch_disconnect(ex.receive, abort_all):
            reasons = [(await t.queue.get()).finish_reason for t in tracked]
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    except RuntimeError as err:
        raise ApiError(503, str(err)) from None
    finally:
        abort_all()
    return "abort" not in reasons
