"""Precise mode on real vLLM with the usual start order: the engines first (the tier's pair, busy
with the tests before), then the gateway.

With the engines' replay socket configured the index is whole within seconds of the gateway's
start, and a prompt primed on a card behind the gateway's back is sent there; without it the log
says plainly that the start was missed and dispatch runs on the model; a gateway restarted while
the engines are busy is whole again at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence

import httpx
import pytest

from taogate.app import RunningGateway, serve_gateway
from taogate.dispatch.blocks import block_hashes
from taogate.settings import Settings
from tests.real.conftest import Pair, Say
from tests.real.gateway import KEY, admin_rows, engine_metrics, keep_busy, sdk, settings_for
from tests.real.models import VOCAB
from tests.real.server import SERVED_MODEL, VllmServer

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("tokenizers")

TRUSTED_WITHIN = 10.0  # seconds from the gateway's start: the target


def _settings(pair: Pair, *, replay: bool) -> Settings:
    settings = settings_for(
        pair.servers, prefill={"tokenizer": str(pair.tokenizer_json)}, dispatch={"prefix_affinity": True}
    )
    for item, server in zip(settings.instances, pair.servers, strict=True):
        item.kv_events = server.kv_events_endpoint
        item.kv_events_replay = server.kv_replay_endpoint if replay else None
    return settings


def _prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed * 7919 + time.time_ns())
    return [rng.randrange(10, VOCAB - 10) for _ in range(tokens)]


async def _direct(http: httpx.AsyncClient, server: VllmServer, prompt: list[int]) -> None:
    """A request straight to the card, past any gateway."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    (await http.post(server.url + "/v1/completions", json=body)).raise_for_status()


async def _trusted(
    gw: RunningGateway,
    caplog: pytest.LogCaptureFixture,
    started: float,
    names: Sequence[str] = ("fast", "slow"),
) -> float:
    """Seconds from ``started`` (wall clock, before the gateway's start) until every instance's index
    was trusted, from the stamps of the lines that said so (the start itself, warm-up included,
    may take longer on a loaded machine). Fails past the target."""
    fleet = gw.gateway.fleet
    deadline = time.monotonic() + TRUSTED_WITHIN
    while not all((i := fleet.get(n).cache.index) is not None and i.trusted for n in names):
        if time.monotonic() > deadline:
            states = {n: (i.trust if (i := fleet.get(n).cache.index) is not None else None) for n in names}
            log = "\n".join(r.getMessage() for r in caplog.records if r.name == "taogate.health")
            raise AssertionError(f"not trusted within {TRUSTED_WITHIN:g} s: {states}\nthe log said:\n{log}")
        await asyncio.sleep(0.05)
    said = [
        min(r.created for r in caplog.records if r.getMessage().startswith(f"instance {n}: precise mode on"))
        for n in names
    ]
    took = max(said) - started
    assert took < TRUSTED_WITHIN, took
    return took


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_engines_first_with_replay_the_index_is_whole_in_seconds_and_routes(
    vllm_pair: Pair, caplog: pytest.LogCaptureFixture, report: Say
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    # Long, so that prefilling it afresh on the fast card is plainly dearer than its last token on the
    # slow one even where the slow card is 15x slower (two shared cores have shown that).
    prompt = _prompt(3500, 1)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        await _direct(http, vllm_pair.slow, prompt)  # primed behind the gateway's back, on the slow card
    started = time.time()
    async with serve_gateway(_settings(vllm_pair, replay=True), key=KEY) as gw:
        took = await _trusted(gw, caplog, started)
        index = gw.gateway.fleet.get("slow").cache.index
        assert index is not None
        assert index.trust.reason == "replayed", index.trust
        assert len(_said(caplog, "precise mode on, recovered")) == 2
        assert not _said(caplog, "missed start")
        blocks = len(prompt) // index.block_size
        assert index.cached_run(block_hashes(prompt, index.block_size)) == blocks
        served: Counter[str] = Counter()
        hits: list[float] = []  # what the slow engine says it found in its cache, per request
        receipts: list[str] = []  # why each went where it went, for the failure messages
        async with sdk(gw) as client, httpx.AsyncClient(timeout=60, trust_env=False) as http:
            for n in range(4):
                before = (await engine_metrics(http, vllm_pair.slow)).prefix_hits or 0.0
                raw = await client.completions.with_raw_response.create(
                    model=SERVED_MODEL,
                    prompt=[*prompt, 5 + n],
                    max_tokens=1,
                    temperature=0,
                    extra_headers={"x-taogate-route": "1"},
                )
                served[raw.headers["x-taogate-instance"]] += 1
                receipts.append(raw.headers["x-taogate-route"])
                hits.append(((await engine_metrics(http, vllm_pair.slow)).prefix_hits or 0.0) - before)
        # The index's run is what the engine finds (it never computes a prompt's last token from cache).
        expected = min(blocks, len(prompt) // index.block_size) * index.block_size
        rows = await admin_rows(gw)
        # What dispatch priced each card by, should the prompt not go where its cache is.
        shown = ("speed", "relative_speed", "inflight")
        seen = {n: {k: row.get(k) for k in shown} for n, row in rows.items()}
        assert all(f"hit {expected} kv_event" in r for r in receipts), (expected, receipts)
        assert hits == [expected] * served["slow"], (hits, expected, served, seen, receipts)
        assert rows["slow"]["precise"]["by"] == "index" and rows["fast"]["precise"]["by"] == "index"
    detail = index.trust.detail if index is not None else "-"
    report(
        f"precise, engines first, replay: trusted {took:.2f} s after the gateway's start "
        f"({detail}); a prompt primed on the slow card went there {served['slow']}/4"
    )
    assert served["slow"] == 4, (served, seen, receipts)


async def test_engines_first_without_replay_the_log_says_the_start_was_missed(
    vllm_pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for server in vllm_pair.servers:  # whatever ran before: the engines have cached something
            await _direct(http, server, _prompt(64, 2))
    async with serve_gateway(_settings(vllm_pair, replay=False), key=KEY) as gw:
        async with sdk(gw) as client:  # a batch of each engine's, past its first, is then seen
            for _ in range(4):
                await client.completions.create(model=SERVED_MODEL, prompt=_prompt(64, 3), max_tokens=1)
        deadline = time.monotonic() + TRUSTED_WITHIN
        while len(_said(caplog, "degraded, missed start")) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for name in ("fast", "slow"):
            lines = _said(
                caplog, f"instance {name}: precise mode degraded, missed start: its first batch seen is seq"
            )
            assert len(lines) == 1, _said(caplog, "precise mode")
            assert "dispatch uses the approximate cache model" in lines[0]
            assert "set kv_events_replay to recover at once" in lines[0]
        rows = await admin_rows(gw)
        assert (
            rows["fast"]["precise"]["by"] == "model" and rows["fast"]["precise"]["reason"] == "missed_start"
        )


async def test_a_gateway_restarted_against_busy_engines_is_whole_at_once(
    vllm_pair: Pair, caplog: pytest.LogCaptureFixture, report: Say
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    settings = _settings(vllm_pair, replay=True)
    # Behind the engines' own work the slow card's warm-up takes a minute here: the gateway listens
    # without waiting for it (what this test holds is the KV index, whole from the start).
    settings.dispatch.warmup_wait = 5.0
    prompt = _prompt(600, 4)
    async with (
        httpx.AsyncClient(timeout=120, trust_env=False) as http,
        keep_busy(http, vllm_pair.fast),
        keep_busy(http, vllm_pair.slow),
    ):
        async with serve_gateway(settings, key=KEY) as first:
            await _trusted(first, caplog, time.time())
        await _direct(http, vllm_pair.fast, prompt)  # while no gateway listens
        caplog.clear()
        started = time.time()
        async with serve_gateway(settings, key=KEY) as again:
            took = await _trusted(again, caplog, started)
            index = again.gateway.fleet.get("fast").cache.index
            assert index is not None
            blocks = len(prompt) // index.block_size
            assert index.cached_run(block_hashes(prompt, index.block_size)) == blocks
            await asyncio.sleep(1.0)  # the engines keep publishing: the index stays whole
            assert index.trusted and not _said(caplog, "degraded, gap"), _said(caplog, "precise mode")
            assert not _said(caplog, "missed start")
    report(f"precise, gateway restarted against busy engines: trusted {took:.2f} s after its start")
