"""The Grafana board's every query returns data from a real Prometheus scraping a real gateway (issue 6).

A real Prometheus (Debian's package) is started with deploy/prometheus.yml, its targets pointed at a
gateway in front of four emulated vLLM instances (one 2.5x slow, one failing half its requests so
retries and breaker trips happen, prefix caching on, tight caps so requests queue and get refused).
deploy/compose/loadgen.py drives streaming and plain traffic, plus a wrong key and an unknown model.
Then every target of every panel in deploy/grafana/dashboards/taogate.json is run through Prometheus's
range-query API, as Grafana would, and must return at least one real (non-NaN) sample.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import tempfile
import time
from asyncio.subprocess import DEVNULL
from pathlib import Path
from typing import Any

import httpx
import yaml

from taogate.emulator.config import EmulatorConfig, Faults
from taogate.serving import bind_socket
from tests.conftest import KEY, GatewayFactory, require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "taogate.json"
MODEL = "emulated-model"

# What Grafana would put in for the board's variables; the test's scrape interval is 1 s.
VARIABLES = {"$__rate_interval": "10s", "$__range": "1m", "$instance": ".*"}


def _dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def _targets(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of every panel."""
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["refId"], target["expr"]))
    return out


def _substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


def _declared_metric_names() -> set[str]:
    observe = ROOT / "src" / "taogate" / "observe"
    source = (observe / "metrics.py").read_text() + (observe / "collectors.py").read_text()
    return set(re.findall(r'"(taogate_[a-z_]+)"', source))


# --- structure (no Prometheus needed) ----------------------------------------------------------------


def test_dashboard_structure_and_metric_names() -> None:
    board = _dashboard()
    assert board["uid"] == "taogate" and board["title"] == "taogate"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    declared = _declared_metric_names()
    used: set[str] = set()
    for title, _, expr in _targets(board):
        _substitute(expr)
        for name in re.findall(r"\btaogate_[a-z_]+", expr):
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert base in declared, f"{title}: {name} is not declared in src/taogate/observe/"
            used.add(base)
    # The list: each of these is on the board.
    for needed in (
        "taogate_requests",
        "taogate_request_duration_seconds",
        "taogate_time_to_first_byte_seconds",
        "taogate_instance_inflight",
        "taogate_instance_prefill_tokens",
        "taogate_queue_length",
        "taogate_instance_up",
        "taogate_instance_breaker_state",
        "taogate_retries",
        "taogate_rejections",
        "taogate_engine_requests_waiting",
        "taogate_engine_requests_running",
        "taogate_engine_kv_cache_usage",
        "taogate_instance_slow",
        "taogate_instance_relative_speed",
    ):
        assert needed in used, f"no panel shows {needed}"


def test_grafana_provisioning_points_at_the_board() -> None:
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/taogate.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


# --- the real thing ------------------------------------------------------------------------------------


def _prometheus_config(gateway: str, instances: list[str]) -> str:
    """deploy/prometheus.yml as shipped, its targets pointed at this test's processes, 1 s scrapes."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["taogate"]["static_configs"][0]["targets"] = [gateway]
    jobs["vllm"]["static_configs"][0]["targets"] = instances
    text: str = yaml.safe_dump(config)
    return text


async def _wait_first_scrape(h: httpx.AsyncClient, url: str, deadline: float) -> None:
    """Until Prometheus is up and has scraped the gateway once. Up is not enough: its scrape manager
    takes up new targets on a 5 s tick, so a load started at once can be half over before the first
    scrape, and a series that exists only while requests flow (the hit rate) may then never be seen."""
    while True:
        try:
            r = await h.get(url + "/api/v1/query", params={"query": 'up{job="taogate"} == 1'})
            if r.status_code == 200 and r.json()["data"]["result"]:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "prometheus did not scrape the gateway"
        await asyncio.sleep(0.1)


async def _extra_traffic(api: str) -> None:
    """A wrong key and an unknown model: the gateway's own refusals."""
    async with httpx.AsyncClient(timeout=10) as h:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = await h.post(api + "/completions", json=body, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await h.post(
            api + "/completions",
            json={**body, "model": "no-such-model"},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 404


def _has_real_sample(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


async def test_every_dashboard_query_returns_data(gateway_factory: GatewayFactory) -> None:
    prometheus = require_tool("prometheus", hint="apt-get install prometheus")
    fleet = [
        EmulatorConfig(enable_prefix_caching=True, seed=0),
        EmulatorConfig(enable_prefix_caching=True, seed=1, faults=Faults(error_rate=0.5)),
        EmulatorConfig(enable_prefix_caching=True, seed=2),
        EmulatorConfig(enable_prefix_caching=True, seed=3, slowdown=2.5),
    ]
    dispatch = {
        "max_queue_per_instance": 2,  # 12 clients > 4 x 2 slots: requests queue ...
        "queue_size": 2,  # ... and some are refused (queue_full)
        "breaker_failures": 2,  # the failing instance trips its breaker
        "breaker_cooldown": 1.0,
        # quick backoff; no budget beyond the floor (3 retries per 10 s): later failures are not retried
        "retry": {"backoff_base": 0.1, "backoff_max": 0.5, "budget_ratio": 0.0},
    }
    sock = bind_socket("127.0.0.1", 0)
    web = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    board = _dashboard()
    async with gateway_factory(fleet, dispatch=dispatch) as gw:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "prometheus.yml"
            instances = [u.removeprefix("http://") for u in gw.fleet.urls]
            cfg.write_text(_prometheus_config(gw.url.removeprefix("http://"), instances))
            proc = await asyncio.create_subprocess_exec(
                prometheus,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address={web}",
                stdout=DEVNULL,
                stderr=DEVNULL,
            )
            try:
                async with httpx.AsyncClient(timeout=10) as h:
                    await _wait_first_scrape(h, f"http://{web}", time.monotonic() + 30)
                    start = time.time()
                    load = await asyncio.create_subprocess_exec(
                        sys.executable,
                        str(DEPLOY / "compose" / "loadgen.py"),
                        f"--url={gw.url}",
                        "--concurrency=12",
                        "--pause=0",
                        "--duration=6",
                        "--bad-every=25",
                        env={**os.environ, "TAOTOKEN_API_KEY": KEY},
                        stdout=DEVNULL,
                    )
                    await asyncio.sleep(1)
                    await _extra_traffic(gw.api_base)
                    assert await asyncio.wait_for(load.wait(), 30) == 0
                    await asyncio.sleep(2.5)  # the last scrapes after the load
                    end = time.time()

                    r = await h.get(
                        f"http://{web}/api/v1/label/instance/values",
                        params={"match[]": "taogate_instance_up"},
                    )
                    assert r.json()["data"] == ["i0", "i1", "i2", "i3"]  # the $instance variable

                    empty = []
                    for title, ref, expr in _targets(board):
                        r = await h.get(
                            f"http://{web}/api/v1/query_range",
                            params={"query": _substitute(expr), "start": start, "end": end, "step": 1},
                        )
                        reply = r.json()
                        assert reply["status"] == "success", (title, ref, reply)
                        if not _has_real_sample(reply["data"]["result"]):
                            empty.append(f"{title} [{ref}]: {expr}")
                    assert not empty, "panels without data:\n" + "\n".join(empty)
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
