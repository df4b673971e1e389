"""/metrics passes promtool, a real Prometheus scrapes it, and the slow card is flagged (only it)."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from asyncio.subprocess import DEVNULL, PIPE, STDOUT
from pathlib import Path

import httpx
import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.serving import bind_socket
from tests.conftest import KEY, GatewayFactory, Running, require_tool

MODEL = "emulated-model"
AUTH = {"authorization": f"Bearer {KEY}"}


async def _load(gw: Running, n: int, concurrency: int, words: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(h: httpx.AsyncClient, i: int) -> None:
        async with sem:
            body = {
                "model": MODEL,
                "prompt": f"request {i} " + "alpha beta gamma delta " * (words // 4),
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with h.stream("POST", gw.api_base + "/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass

    async with httpx.AsyncClient(headers=AUTH, timeout=60) as h:
        await asyncio.gather(*(one(h, i) for i in range(n)))


async def test_metrics_pass_promtool(gw: Running) -> None:
    promtool = require_tool("promtool", hint="apt-get install prometheus")
    await _load(gw, 6, 3, 200)
    async with httpx.AsyncClient(headers=AUTH) as h:
        await h.post(gw.api_base + "/completions", json={"model": "nope", "prompt": "x"})
        text = (await h.get(gw.url + "/metrics")).text
    for name in (
        "taogate_requests_total",
        "taogate_time_to_first_byte_seconds_bucket",
        "taogate_instance_inflight",
        "taogate_instance_prefill_tokens",
        "taogate_engine_requests_waiting",
        "taogate_engine_kv_cache_usage",
        "taogate_instance_breaker_state",
        "taogate_rejections_total",
        "taogate_queue_length",
        "taogate_build_info",
        "taogate_upstream_connections",
    ):
        assert name in text, name
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"
    }
    assert values['taogate_upstream_connections{state="in_use"}'] == 0  # the load is over: kept alive
    assert values['taogate_upstream_connections{state="idle"}'] >= 1
    assert "taogate_upstream_connections_limit" not in text  # no max_connections: no limit of its own
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics", stdin=PIPE, stdout=PIPE, stderr=STDOUT
    )
    out, _ = await proc.communicate(text.encode())
    assert proc.returncode == 0, out.decode()


def _slow_fleet(slow: float | None) -> list[EmulatorConfig]:
    base = {"prefill_tokens_per_s": 60_000.0, "step_overhead": 0.004, "max_num_batched_tokens": 4096}
    return [EmulatorConfig(seed=i, slowdown=slow if (slow and i == 2) else 1.0, **base) for i in range(4)]  # type: ignore[arg-type]


async def _rows(gw: Running) -> list[dict[str, object]]:
    async with httpx.AsyncClient(headers=AUTH) as h:
        r = await h.get(gw.url + "/admin/instances")
        assert r.status_code == 200
        rows: list[dict[str, object]] = r.json()["instances"]
        return rows


async def test_slow_instance_is_flagged_in_metrics_status_and_log(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    # A cap the load fills on the fast cards, so the slow one keeps getting work: routed around
    # it, the load once left it 4 requests in four rounds of 160, too few (and, on a busy machine,
    # too scattered) for the detector to be sure of.
    async with gateway_factory(_slow_fleet(3.0), dispatch={"max_queue_per_instance": 4}) as gw:
        # Bounded: at most four rounds of load, until the detector is sure.
        rows: list[dict[str, object]] = []
        for _ in range(4):
            await _load(gw, 160, 16, 2000)
            for _ in range(10):
                rows = await _rows(gw)
                if any(r["slow"] for r in rows):
                    break
                await asyncio.sleep(0.1)
            if any(r["slow"] for r in rows):
                break
        flagged = [r["name"] for r in rows if r["slow"]]
        keys = ("name", "relative_speed", "requests_1m", "speed", "verdict")
        assert flagged == ["i2"], [{k: r.get(k) for k in keys} for r in rows]
        row = next(r for r in rows if r["name"] == "i2")
        assert str(row["verdict"]).startswith("slow")
        assert isinstance(row["relative_speed"], float) and row["relative_speed"] < 0.6
        async with httpx.AsyncClient() as h:
            text = (await h.get(gw.url + "/metrics")).text
        assert 'taogate_instance_slow{instance="i2"} 1.0' in text
        assert 'taogate_instance_slow{instance="i0"} 0.0' in text
    slow_lines = [r.getMessage() for r in caplog.records if "is slow" in r.getMessage()]
    assert len(slow_lines) == 1 and slow_lines[0].startswith("instance i2 is slow")


async def test_homogeneous_fleet_flags_nothing(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(_slow_fleet(None)) as gw:
        await _load(gw, 64, 4, 2000)
        await asyncio.sleep(0.5)
        rows = await _rows(gw)
        assert not [r["name"] for r in rows if r["slow"]], rows
        assert all(r["verdict"] == "ok" for r in rows), rows
        assert sum(int(r["requests_1m"]) for r in rows) == 64  # type: ignore[call-overload]


async def test_a_real_prometheus_scrapes_the_gateway(gw: Running) -> None:
    prometheus = require_tool("prometheus", hint="apt-get install prometheus")
    await _load(gw, 4, 2, 100)
    target = gw.url.removeprefix("http://")
    sock = bind_socket("127.0.0.1", 0)
    web_port = sock.getsockname()[1]
    sock.close()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n"
            f"  - job_name: taogate\n    static_configs:\n      - targets: ['{target}']\n"
        )
        proc = await asyncio.create_subprocess_exec(
            prometheus,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address=127.0.0.1:{web_port}",
            stdout=DEVNULL,
            stderr=DEVNULL,
        )
        try:
            value = None
            async with httpx.AsyncClient(timeout=5) as h:
                for _ in range(100):
                    try:
                        r = await h.get(
                            f"http://127.0.0.1:{web_port}/api/v1/query",
                            params={"query": "sum(taogate_requests_total)"},
                        )
                        result = r.json()["data"]["result"] if r.status_code == 200 else []
                        if result:
                            value = float(result[0]["value"][1])
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.2)
            assert value is not None and value >= 4
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def test_the_last_minute_s_ttft_is_of_streams_only(gateway_factory: GatewayFactory) -> None:
    """A whole answer's first byte is its last: as a TTFT (status, the fleet page) it made an
    instance read many times slower than it is."""
    async with gateway_factory([EmulatorConfig()]) as gw, httpx.AsyncClient(headers=AUTH, timeout=30) as h:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 40}
        assert (await h.post(gw.api_base + "/completions", json=body)).status_code == 200
        window = gw.gateway.fleet.get("i0").window
        assert window.stats(gw.gateway.clock()).ttft_p50 is None
        assert window.stats(gw.gateway.clock()).requests == 1
        async with h.stream("POST", gw.api_base + "/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            await r.aread()
        assert window.stats(gw.gateway.clock()).ttft_p50 is not None
