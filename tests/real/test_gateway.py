"""The gateway in front of the real pair: the routes answer what vLLM answers, streams carry usage,
errors pass through, a client that leaves frees vLLM's slot, the admin rows show vLLM's own stats,
the warm-up is accepted, and the 404 advice fits the path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
import openai
import pytest

from tests.real.conftest import Pair
from tests.real.gateway import (
    LONG_GENERATION,
    admin_rows,
    engine_metrics,
    keep_busy,
    real_gateway,
    running,
    sdk,
    unique_prompt,
)
from tests.real.server import SERVED_MODEL, VllmServer

IDS = ("id", "created", "created_at")  # what differs between two identical answers
NO_WARMUP = {"warmup_tokens": 0}


def without_ids(value: Any) -> Any:
    """The answer with its ids and timestamps dropped, at every depth (responses nest them)."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in IDS}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def server_named(pair: Pair, name: str) -> VllmServer:
    return {s.spec.label: s for s in pair.servers}[name]


ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 5, "temperature": 0}),
    ("/tokenize", {"prompt": "Hello there"}),
    ("/detokenize", {"tokens": [100, 200, 300]}),
    ("/v1/embeddings", {"input": "hello"}),  # a generative model: vLLM answers 404, passed through
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
async def test_routes_answer_what_the_serving_instance_answers(
    vllm_pair: Pair, path: str, body: dict[str, Any]
) -> None:
    # Prompts shorter than a cache block (128 tokens): no prefix-cache hit can change an answer.
    payload = {"model": SERVED_MODEL, **body}
    async with (
        real_gateway(vllm_pair.servers, dispatch=NO_WARMUP) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):
        via = await http.post(gw.url + path, json=payload, headers={"authorization": f"Bearer {gw.key}"})
        instance = via.headers["x-taogate-instance"]
        direct = await http.post(server_named(vllm_pair, instance).url + path, json=payload)
    assert via.status_code == direct.status_code, (via.text, direct.text)
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert without_ids(via.json()) == without_ids(direct.json())


async def test_streams_carry_usage_through_the_sdk(vllm_pair: Pair) -> None:
    async with real_gateway(vllm_pair.servers, dispatch=NO_WARMUP) as gw, sdk(gw) as client:
        stream = await client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 3


async def test_upstream_errors_pass_through_unchanged(vllm_pair: Pair) -> None:
    too_many = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 5000}
    bad_type = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": "five"}
    async with (
        real_gateway(vllm_pair.servers, dispatch=NO_WARMUP) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):
        for body in (too_many, bad_type):
            via = await http.post(
                gw.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {gw.key}"}
            )
            direct = await http.post(vllm_pair.fast.url + "/v1/completions", json=body)
            assert via.status_code == direct.status_code == 400
            assert via.json() == direct.json()
        async with sdk(gw) as client:
            with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
                await client.completions.create(**too_many)  # type: ignore[call-overload]


async def test_unknown_path_advice_fits_the_path(vllm_pair: Pair) -> None:
    async with (
        real_gateway(vllm_pair.servers, dispatch=NO_WARMUP) as gw,
        httpx.AsyncClient(timeout=30, trust_env=False) as http,
    ):
        headers = {"authorization": f"Bearer {gw.key}"}
        on_api = (await http.get(gw.url + "/v1/nope", headers=headers)).json()["error"]["message"]
        off_api = (await http.get(gw.url + "/chat/completions", headers=headers)).json()["error"]["message"]
    # A client already under /v1 has the right base_url: telling it to add /v1 sends it to /v1/v1.
    assert "base_url" not in on_api and "/v1/nope" in on_api
    assert "base_url" in off_api


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_a_client_that_leaves_frees_the_running_slot(vllm_pair: Pair, stream: bool) -> None:
    body = LONG_GENERATION
    # A non-streamed answer goes to the slow card: vLLM sees a disconnect only when its server's loop
    # runs, which on two busy cores can take seconds, longer than the fast card needs for the answer.
    behind = vllm_pair.servers if stream else [vllm_pair.slow]
    async with (
        real_gateway(behind, dispatch=NO_WARMUP) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):
        headers = {"authorization": f"Bearer {gw.key}"}

        async def busy() -> float:
            return sum([await running(http, s) for s in vllm_pair.servers])

        if stream:
            async with (
                httpx.AsyncClient(timeout=60, trust_env=False) as client,
                client.stream(
                    "POST", gw.url + "/v1/completions", json={**body, "stream": True}, headers=headers
                ) as response,
            ):
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
                assert await busy() == 1
            # The block closed the connection mid-stream.
            left = time.monotonic()
            while await busy() > 0:
                assert time.monotonic() - left < 5, "vLLM still runs the abandoned request"
                await asyncio.sleep(0.05)
        else:
            # vLLM's /metrics hardly answers while it builds a long non-streamed answer, so "it runs"
            # is read from its counters: the client leaves once the prompt was prefilled (however long
            # this machine takes to get there), and the answer must never finish.
            async def counts() -> tuple[float, float]:
                seen = [await engine_metrics(http, s) for s in vllm_pair.servers]
                return sum(m.prompt_tokens or 0 for m in seen), sum(m.request_success or 0 for m in seen)

            prompts, finished = await counts()
            async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                request = asyncio.create_task(
                    client.post(gw.url + "/v1/completions", json=body, headers=headers)
                )
                deadline = time.monotonic() + 30
                try:
                    while (await counts())[0] <= prompts:
                        assert not request.done(), "the 3,000-token answer came back before it ran"
                        assert time.monotonic() < deadline, "the request never ran"
                        await asyncio.sleep(0.05)
                finally:
                    request.cancel()  # the client leaves: httpx closes the connection mid-answer
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
            left = time.monotonic()
            while await busy() > 0:
                assert time.monotonic() - left < 5, "vLLM still runs the abandoned request"
                await asyncio.sleep(0.05)
            prompts_after, finished_after = await counts()
            assert prompts_after > prompts, "the request never ran"
            assert finished_after == finished, "vLLM finished the abandoned request"


async def test_admin_rows_show_what_vllm_reports(vllm_pair: Pair) -> None:
    card, other = vllm_pair.slow, vllm_pair.fast
    name = card.spec.label
    async with (
        real_gateway(vllm_pair.servers, dispatch=NO_WARMUP) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
        # Straight to vLLM, past the gateway: only the scrape can tell the gateway about it. Streamed:
        # vLLM's /metrics hardly answers while it generates a long non-streamed answer.
        keep_busy(http, card) as busy,
    ):
        # The row and vLLM's own /metrics are read one after the other, until they agree: both saw the
        # answer running, and its KV blocks to within one (the answer grows a block every 128 tokens,
        # and the gateway's scrape may be a second older than ours; the next one starts at once).
        # The deadline is generous: on two shared cores both servers' /metrics have been seen to
        # stall for tens of seconds; the failure message says where the time went.
        deadline = time.monotonic() + 75
        while True:
            began = time.monotonic()
            rows = await admin_rows(gw)
            row = rows[name]
            read = time.monotonic()
            own = await engine_metrics(http, card)
            took = (round(read - began, 2), round(time.monotonic() - read, 2))
            assert own.cache_config is not None and own.kv_usage is not None
            block = 1.0 / own.cache_config.num_gpu_blocks
            if (
                row["engine_running"] == 1
                and own.running == 1
                and row["kv_usage"] > 0
                and abs(row["kv_usage"] - own.kv_usage) <= 1.5 * block
            ):
                break
            shown = {k: row[k] for k in ("engine_running", "kv_usage", "scrape_age", "verdict")}
            assert time.monotonic() < deadline, (
                f"row {shown}, vLLM running {own.running} KV usage {own.kv_usage}; answers started "
                f"{busy.started}, the last {busy.last}; the last reads took {took} s; this loop was "
                f"up to {busy.loop_late:.2f} s late; vLLM {name}'s log ends:\n{card.log_tail(20)}"
            )
            await asyncio.sleep(0.1)
    assert own.waiting == 0 and row["engine_waiting"] == 0 and row["inflight"] == 0
    assert rows[other.spec.label]["engine_running"] == 0


async def test_warm_up_is_accepted_before_any_traffic(
    vllm_pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        before = {
            s.spec.label: (await engine_metrics(http, s)).request_success or 0 for s in vllm_pair.servers
        }
        async with real_gateway(vllm_pair.servers) as gw:
            rows = await admin_rows(gw)
            after = {
                s.spec.label: (await engine_metrics(http, s)).request_success or 0 for s in vllm_pair.servers
            }
    for name in ("fast", "slow"):
        assert after[name] - before[name] == 4, (name, before, after, caplog.text)  # the warm-up prompts
        assert rows[name]["speed_samples"] >= 1, rows[name]
        assert f"instance {name} warmed up" in caplog.text
    # Learned from the warm-up alone, before the first request: the slow card is known slow.
    assert rows["slow"]["speed"] < 0.5 * rows["fast"]["speed"], (rows["fast"]["speed"], rows["slow"]["speed"])


async def test_unique_prompts_are_what_they_say(vllm_pair: Pair) -> None:
    """The tier's own traffic helper: its prompts are ~1.45 tokens a word on this tokenizer."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        r = await http.post(vllm_pair.fast.url + "/tokenize", json={"prompt": unique_prompt(700)})
    assert 800 < r.json()["count"] < 1400
