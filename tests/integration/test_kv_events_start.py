"""Start orders in precise mode, with emulated engines publishing vLLM's KV events (and replay socket).

Engines first, busy before the gateway: with ``kv_events_replay`` the index is whole at once and
prompts follow blocks the gateway never sent; without it the log says the start was missed and
dispatch runs on the model. Idle engines: complete from the gateway's own warm-up (it waits for the
subscription), or, with no warm-up, from the engine's counters.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from taogate.app import RunningGateway
from taogate.bench.procs import free_port
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import Fleet, run_fleet
from tests.conftest import wait_until

from .dispatch_helpers import AUTH, MODEL, client, serve_gateway, settings_for
from .test_dispatch_precise import _tokenizer

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

PREFIX = list(range(2000, 2640))  # 40 blocks of 16


def _configs(replay: bool) -> list[EmulatorConfig]:
    return [
        EmulatorConfig(
            seed=i,
            enable_prefix_caching=True,
            enable_prompt_tokens_details=True,
            kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
            kv_events_replay=f"tcp://127.0.0.1:{free_port()}" if replay else None,
        )
        for i in range(2)
    ]


@asynccontextmanager
async def _gateway(
    fleet: Fleet, configs: Sequence[EmulatorConfig], tmp: Path, *, replay: bool, warmup: int
) -> AsyncIterator[RunningGateway]:
    settings = settings_for(
        fleet.urls,
        names=["i0", "i1"],
        prefill={"tokenizer": str(_tokenizer(tmp))},
        dispatch={"prefix_affinity": True, "warmup_tokens": warmup, "scrape_interval": 0.2},
    )
    for item, config in zip(settings.instances, configs, strict=True):
        item.kv_events = config.kv_events_endpoint
        item.kv_events_replay = config.kv_events_replay if replay else None
    async with serve_gateway(settings) as gate:
        yield gate


async def _direct(url: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert (await http.post(url + "/v1/completions", json=body)).status_code == 200


async def _rows(gate: RunningGateway) -> dict[str, dict[str, Any]]:
    async with client() as http:
        reply = await http.get(gate.url + "/admin/instances", headers=AUTH)
        return {row["name"]: row for row in reply.json()["instances"]}


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.timeout(60)
async def test_engines_first_with_replay_index_whole_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    configs = _configs(replay=True)
    async with run_fleet(configs) as fleet:
        for n in range(5):  # busy before the gateway: nobody hears these batches live
            await _direct(fleet.urls[0], [60_000 + n] * 64)
        await _direct(fleet.urls[1], [*PREFIX, 7])
        async with _gateway(fleet, configs, tmp_path, replay=True, warmup=64) as gate:
            caches = [gate.gateway.fleet.get(n).cache for n in ("i0", "i1")]
            await wait_until(
                lambda: all(c.index is not None and c.index.trusted for c in caches),
                within=10.0,
                what="trusted",
            )
            assert [c.index.trust.reason for c in caches if c.index is not None] == ["replayed", "replayed"]
            assert len(_said(caplog, "precise mode on, recovered")) == 2
            assert not _said(caplog, "missed start")
            async with client() as http:
                for n in range(4):  # primed on i1 behind the gateway's back: found there
                    body = {"model": MODEL, "prompt": [*PREFIX, 9, n], "max_tokens": 1}
                    reply = await http.post(gate.api_base + "/completions", json=body)
                    assert reply.headers["x-taogate-instance"] == "i1"
                    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 624
                metrics = (await http.get(gate.url + "/metrics")).text
            line = 'taogate_kv_index_dispatch{by="index",instance="i1",reason="replayed"} 1.0'
            assert line in metrics
            rows = await _rows(gate)
            assert rows["i1"]["precise"]["by"] == "index"


@pytest.mark.timeout(60)
async def test_engines_first_without_replay_the_missed_start_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    configs = _configs(replay=False)
    async with run_fleet(configs) as fleet:
        for url in fleet.urls:
            await _direct(url, [*PREFIX, 7])
        async with _gateway(fleet, configs, tmp_path, replay=False, warmup=64) as gate:
            await wait_until(lambda: len(_said(caplog, "missed start")) == 2, what="the missed start said")
            line = _said(caplog, "instance i0: precise mode degraded, missed start")[0]
            assert "dispatch uses the approximate cache model" in line and "kv_events_replay" in line
            rows = await _rows(gate)
            assert rows["i0"]["precise"] == {
                "by": "model",
                "reason": "missed_start",
                "detail": rows["i0"]["precise"]["detail"],
            }
            assert "its first batch seen is seq 1" in rows["i0"]["precise"]["detail"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("warmup", [64, 0])
async def test_idle_engines_first_are_trusted_from_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, warmup: int
) -> None:
    """With a warm-up, its batch is the engine's first (the warm-up waits for the subscription);
    without one, the engine's counters say it has cached nothing."""
    caplog.set_level(logging.INFO, "taogate.health")
    configs = _configs(replay=False)
    async with (
        run_fleet(configs) as fleet,
        _gateway(fleet, configs, tmp_path, replay=False, warmup=warmup) as gate,
    ):
        caches = [gate.gateway.fleet.get(n).cache for n in ("i0", "i1")]
        await wait_until(
            lambda: all(c.index is not None and c.index.trusted for c in caches), within=10.0, what="trusted"
        )
        expected = "from_start" if warmup else "quiet"
        assert [c.index.trust.reason for c in caches if c.index is not None] == [expected, expected]
        assert not _said(caplog, "missed start")
