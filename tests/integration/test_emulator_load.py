"""Load-dependent behaviour over loopback: metrics under load, aborts on disconnect, prefix cache, tags."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from taogate.emulator import run_fleet
from tests.conftest import wait_until

from .emulator_helpers import fast_config, metric


async def test_metrics_move_as_load_arrives() -> None:
    # Two slots and 20 ms steps: six requests give 2 running + 4 waiting for a while.
    config = fast_config(max_num_seqs=2, step_overhead=0.02)
    async with run_fleet([config]) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        inst = fleet.instances[0]
        body = {"prompt": "the same short prompt", "max_tokens": 4}
        load = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(6)]
        await wait_until(lambda: inst.engine.num_waiting == 4)
        text = (await http.get("/metrics")).text
        assert metric(text, "vllm:num_requests_running") == 2
        assert metric(text, "vllm:num_requests_waiting") == 4
        assert 0 < metric(text, "vllm:kv_cache_usage_perc") < 1
        replies = await asyncio.gather(*load)
        assert all(r.status_code == 200 for r in replies)
        text = (await http.get("/metrics")).text
        assert metric(text, "vllm:num_requests_running") == metric(text, "vllm:num_requests_waiting") == 0
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 6
        assert metric(text, "vllm:prompt_tokens_total") == 6 * 4
        assert metric(text, "vllm:generation_tokens_total") == 6 * 4
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 6
        assert metric(text, "vllm:e2e_request_latency_seconds_count") == 6
        # Waves of two, 4 steps of 20 ms each: latencies ~0.08, 0.16, 0.24 s per pair (queueing shows).
        assert metric(text, "vllm:e2e_request_latency_seconds_sum") > 0.5


async def test_abandoned_stream_is_aborted_and_frees_its_slot() -> None:
    async with run_fleet([fast_config(step_overhead=0.01)]) as fleet:
        inst = fleet.instances[0]
        body = {"prompt": "go on", "max_tokens": 10_000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=fleet.urls[0]) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            got = [line async for line in _take(response.aiter_lines(), 3)]
            assert all(line.startswith("data: ") for line in got)
            assert inst.engine.num_running == 1
        # Leaving the block closed the connection mid-stream: the client is gone.
        await wait_until(lambda: inst.stats()["aborted"] == 1)
        stats = inst.stats()
        assert (stats["running"], stats["waiting"], stats["in_flight"]) == (0, 0, 0)
        assert inst.engine.kv_usage == 0.0
        assert stats["records"][-1]["finish_reason"] == "abort"
        # As in vLLM, a client's disconnect is not counted as a finish reason.
        assert (
            metric(inst.metrics_text().decode(), "vllm:request_success_total", finished_reason="abort") == 0
        )


async def test_abandoned_non_stream_request_is_aborted() -> None:
    async with run_fleet([fast_config(step_overhead=0.01)]) as fleet:
        inst = fleet.instances[0]
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=0.2) as http:
            try:
                await http.post("/v1/completions", json={"prompt": "long answer", "max_tokens": 10_000})
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("expected the client to give up")
        await wait_until(lambda: inst.stats()["aborted"] == 1)
        assert inst.engine.num_running == 0 and inst.stats()["in_flight"] == 0


async def _take(lines: AsyncIterator[str], n: int) -> AsyncIterator[str]:
    """The first ``n`` non-empty lines (SSE events are separated by blank lines)."""
    count = 0
    async for line in lines:
        if line:
            yield line
            count += 1
            if count == n:
                return


async def test_prefix_cache_hits_show_in_usage_and_metrics() -> None:
    config = fast_config(enable_prefix_caching=True, enable_prompt_tokens_details=True)
    async with run_fleet([config]) as fleet:
        async with httpx.AsyncClient(base_url=fleet.urls[0]) as http:
            shared = "Our shared system prompt is long . " * 40  # 280 tokens → 17 full blocks
            first = (await http.post("/v1/completions", json={"prompt": shared + "question one"})).json()
            second = (await http.post("/v1/completions", json={"prompt": shared + "question two"})).json()
            text = (await http.get("/metrics")).text
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 272
        assert metric(text, "vllm:prefix_cache_hits_total") == 272
        assert metric(text, "vllm:prefix_cache_queries_total") == 2 * 282


async def test_tags_ids_and_records_tell_who_served_what() -> None:
    async with run_fleet([fast_config(enable_request_id_headers=True), fast_config()]) as fleet:
        for i, url in enumerate(fleet.urls):
            async with httpx.AsyncClient(base_url=url) as http:
                headers = {"X-Request-Tag": "prefill-bench", "X-Request-Id": f"req-{i}"}
                r = await http.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers
                )
                assert r.json()["id"] == f"cmpl-req-{i}"
                # Only with --enable-request-id-headers does vLLM echo the id as a header.
                assert r.headers.get("x-request-id") == (f"req-{i}" if i == 0 else None)
        for i, inst in enumerate(fleet.instances):
            stats = inst.stats()
            assert stats["tags"] == {"prefill-bench": 1}
            (record,) = stats["records"]
            assert (record["id"], record["tag"], record["finish_reason"]) == (
                f"req-{i}",
                "prefill-bench",
                "length",
            )
            assert record["arrival"] <= record["first_token"] <= record["finish"]
        async with httpx.AsyncClient(base_url=fleet.urls[0]) as http:
            assert (await http.get("/emulator/stats")).json()["records"][0]["id"] == "req-0"


async def test_stop_word_finishes_with_stop() -> None:
    async with run_fleet([fast_config()]) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        full = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 6})).json()
        words = full["choices"][0]["text"].split()
        stopped = (
            await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "stop": words[3]})
        ).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["choices"][0]["text"].split() == words[:3]
        text = (await http.get("/metrics")).text
        assert metric(text, "vllm:request_success_total", finished_reason="stop") == 1
