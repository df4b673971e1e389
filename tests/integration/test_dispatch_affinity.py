"""Prefix affinity: requests that share a long system prompt meet the instance that has it cached."""

from __future__ import annotations

import asyncio
import logging
import random

import openai
import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from tests.conftest import KEY

from .dispatch_helpers import MODEL, admin_rows, client, hit_rate, serve_gateway, settings_for, words

SYSTEMS = [words(1_000, seed=500 + s) for s in range(6)]  # 6 distinct ~1,000-token system prompts


async def _shared_prefix_run(**dispatch: object) -> tuple[float, str]:
    """36 chat requests (6 system prompts x 6 short questions, shuffled), 4 at a time, through the
    OpenAI SDK; the fleet's prefix-cache hit rate and the gateway's /metrics text."""
    configs = [EmulatorConfig(seed=i, enable_prefix_caching=True) for i in range(4)]
    async with run_fleet(configs) as fleet:
        settings = settings_for(fleet.urls, dispatch=dict(dispatch))
        async with serve_gateway(settings) as gate:
            sdk = openai.AsyncOpenAI(base_url=gate.api_base, api_key=KEY, max_retries=0, timeout=30)
            jobs = [(s, q) for s in range(6) for q in range(6)]
            random.Random(7).shuffle(jobs)
            slots = asyncio.Semaphore(4)

            async def ask(system: int, question: int) -> None:
                async with slots:
                    reply = await sdk.chat.completions.create(
                        model=MODEL,
                        messages=[
                            {"role": "system", "content": SYSTEMS[system]},
                            {"role": "user", "content": f"question {question} about part {system}?"},
                        ],
                        max_tokens=2,
                    )
                assert reply.choices[0].message.content

            try:
                await asyncio.gather(*(ask(s, q) for s, q in jobs))
            finally:
                await sdk.close()
            async with client() as http:
                metrics = (await http.get(gate.url + "/metrics")).text
        return hit_rate(fleet), metrics


async def test_shared_prefixes_meet_their_cache() -> None:
    with_affinity, metrics = await _shared_prefix_run(strategy="least_busy", prefix_affinity=True)
    blind, _ = await _shared_prefix_run(strategy="round_robin", prefix_affinity=False)
    # With affinity each system prompt is prefilled about once (6 misses in 36: at most ~0.82); round
    # robin spreads every prompt over all four caches (~0.52 here). Margins allow a few overrides
    # when the machine is loaded.
    assert with_affinity > 0.65, with_affinity
    assert blind < 0.6, blind
    assert with_affinity > blind + 0.15, (with_affinity, blind)
    assert 'reason="affinity_hit",strategy="least_busy"' in metrics


async def test_a_route_receipt_names_the_pick_the_runner_up_and_the_evidence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """X-Taogate-Route: 1 makes the answer say why it went there, term by term; the same line goes
    to the debug log. After a first answer, the prefix is evidenced as computed on its instance."""
    configs = [EmulatorConfig(seed=i, enable_prefix_caching=True) for i in range(2)]
    async with run_fleet(configs) as fleet, serve_gateway(settings_for(fleet.urls)) as gate:
        sdk = openai.AsyncOpenAI(base_url=gate.api_base, api_key=KEY, max_retries=0, timeout=30)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEMS[0]},
            {"role": "user", "content": "why?"},
        ]
        try:
            plain = await sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                max_tokens=2,
            )
            assert plain.headers.get("x-taogate-route") is None  # not asked: not given
            with caplog.at_level(logging.DEBUG, logger="taogate.dispatch"):
                asked = await sdk.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=2,
                    extra_headers={"X-Taogate-Route": "1"},
                )
        finally:
            await sdk.close()
    line = asked.headers["x-taogate-route"]
    served = asked.headers["x-taogate-instance"]
    assert line.startswith("affinity_hit: " + served + " est=")
    for term in ("fixed=", "queued=", "own=", "decode=", "runner-up"):
        assert term in line
    assert "computed)" in line.split(";")[0]  # the first answer there is the evidence
    assert len(line) <= 600
    assert any(line in r.getMessage() for r in caplog.records)


async def _in_flight_followers(config: EmulatorConfig) -> tuple[float | None, str]:
    """Four leaders, each followed 0.1 s later (mid-prefill) by a request sharing its ~5,000-token
    system prompt, on one instance; the last follower asks for a receipt. Returns that instance's
    learned ``follower_hits`` and the receipt."""
    system = [words(5_000, seed=900 + s) for s in range(4)]
    async with run_fleet([config]) as fleet, serve_gateway(settings_for(fleet.urls)) as gate:
        sdk = openai.AsyncOpenAI(base_url=gate.api_base, api_key=KEY, max_retries=0, timeout=60)

        async def ask(s: int, question: str, headers: dict[str, str]) -> str:
            reply = await sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "system", "content": system[s]}, {"role": "user", "content": question}],
                max_tokens=2,
                extra_headers=headers,
            )
            return reply.headers.get("x-taogate-route", "")

        try:
            receipt = ""
            for s in range(4):
                leader = asyncio.ensure_future(ask(s, "first?", {}))
                await asyncio.sleep(0.1)
                receipt = await ask(s, "second?", {"X-Taogate-Route": "1"})
                await leader
        finally:
            await sdk.close()
        async with client() as http:
            (row,) = (await admin_rows(http, gate)).values()
    return row["follower_hits"], receipt


async def test_followers_in_flight_are_priced_as_hits_only_where_their_answers_showed_hits() -> None:
    """An engine that hits a follower of a prefix still in flight (vLLM: blocks are cached as they
    are scheduled) teaches the gateway so from the followers' ``cached_tokens``: the fourth follower
    is priced as a hit (evidence ``in_flight``). One that caches a prompt only once its prefill
    completes never does: its followers stay at their whole prompt."""
    like_vllm = EmulatorConfig(enable_prefix_caching=True, enable_prompt_tokens_details=True)
    learned, receipt = await _in_flight_followers(like_vllm)
    assert learned is not None and learned >= 0.5, learned
    assert "in_flight)" in receipt.split(";")[0], receipt
    after_prefill = EmulatorConfig(
        enable_prefix_caching=True, enable_prompt_tokens_details=True, hits_after_prefill=True
    )
    missed, receipt = await _in_flight_followers(after_prefill)
    assert missed is None or missed < 0.5, missed
    assert "sent)" in receipt.split(";")[0], receipt
