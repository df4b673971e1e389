"""Behind a real Envoy, fail closed: a subset hint honoured (or 503), a full fleet shed with 429 (a
sheddable objective's request at once, as ``shed``), and a picker that dies gives fast 5xx, never a
hang, until it is back."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from taogate.bench.procs import Child, free_port
from tests.conftest import KEY
from tests.envoy import stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "emulated-model"
HINT = "x-test-subset"
#: Before ext_proc: a request header becomes the subset hint, as an inference gateway would set it.
SUBSET_FILTER: dict[str, Any] = {
    "name": "envoy.filters.http.header_to_metadata",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [
            {
                "header": HINT,
                "on_header_present": {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "key": "x-gateway-destination-endpoint-subset",
                    "type": "STRING",
                },
                "remove": True,
            }
        ],
    },
}


@dataclass(slots=True)
class Closed:
    workdir: Path
    fleet: Child
    config: Path
    envoy: stack.Envoy
    port: int  # the picker's gRPC port: a restarted picker takes it again
    pickers: list[stack.Picker] = field(default_factory=list)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def closed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Closed]:
    """Three instances, each taking one request at a time with no gateway queue: the fourth at
    once is shed."""
    workdir = tmp_path_factory.mktemp("closed")
    async with stack.fleet(workdir / "fleet.log", 3) as fleet:
        config = workdir / "config.toml"
        extra = "max_queue_per_instance = 1\nqueue_size = 0\n[picker]\nobjectives = { batch = -5 }\n"
        stack.write_config(config, fleet.urls, extra)
        port = free_port()
        async with contextlib.AsyncExitStack() as exits:
            first = await exits.enter_async_context(stack.picker(workdir, config, port=port))
            doc = stack.bootstrap(free_port(), free_port(), [port], failure_mode_allow=False)
            filters = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            filters["typed_config"]["http_filters"].insert(0, SUBSET_FILTER)
            envoy = await exits.enter_async_context(stack.envoy(workdir, doc))
            yield Closed(workdir, fleet, config, envoy, port, [first])


def _chat(max_tokens: int = 2, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=15, headers={"authorization": f"Bearer {KEY}"})


async def test_subset_hint_is_honoured_or_503(closed: Closed) -> None:
    rows = await stack.instances(closed.pickers[-1])
    target = "emu1"
    endpoint = rows[target]["url"].removeprefix("http://")
    async with _client() as http:
        url = closed.envoy.api_base + "/chat/completions"
        for _ in range(6):
            r = await http.post(url, json=_chat(), headers={HINT: endpoint})
            assert r.status_code == 200 and r.headers["x-taogate-instance"] == target
        r = await http.post(url, json=_chat(), headers={HINT: "127.0.0.1:1"})  # no instance of ours
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance"
        r = await http.post(url, json=_chat(), headers={HINT: f"127.0.0.1:1, {endpoint}"})  # a list
        assert r.status_code == 200 and r.headers["x-taogate-instance"] == target


async def test_full_fleet_is_shed_with_429(closed: Closed) -> None:
    url = closed.envoy.api_base + "/chat/completions"
    async with _client() as http, contextlib.AsyncExitStack() as held:
        for _ in range(3):  # one long stream per instance: every instance at its cap
            r = await held.enter_async_context(http.stream("POST", url, json=_chat(4000, stream=True)))
            assert r.status_code == 200
        shed = await http.post(url, json=_chat())
        assert shed.status_code == 429
        assert shed.json()["error"]["type"] == "rate_limit_error" and "retry-after" in shed.headers
    async with _client() as http:  # the held streams are gone: their leases too
        for _ in range(200):
            rows = await stack.instances(closed.pickers[-1])
            if all(r["inflight"] == 0 for r in rows.values()):
                break
            await asyncio.sleep(0.05)
        assert (await http.post(url, json=_chat())).status_code == 200


async def test_a_sheddable_objective_is_refused_at_once_as_shed(closed: Closed) -> None:
    """The Inference Extension's objective header, as a route would set it, reaches the picker
    through Envoy: with every instance at its cap, a request of a negative-priority objective is
    shed; one naming none is refused as the full queue it met."""
    url = closed.envoy.api_base + "/chat/completions"
    async with _client() as http, contextlib.AsyncExitStack() as held:
        for _ in range(3):
            r = await held.enter_async_context(http.stream("POST", url, json=_chat(4000, stream=True)))
            assert r.status_code == 200
        batch = await http.post(url, json=_chat(), headers={"x-gateway-inference-objective": "batch"})
        plain = await http.post(url, json=_chat())
    assert batch.status_code == 429 and batch.json()["error"]["code"] == "shed", batch.text
    assert plain.status_code == 429 and plain.json()["error"]["code"] != "shed", plain.text


async def test_killed_picker_gives_fast_5xx_then_recovers(closed: Closed) -> None:
    url = closed.envoy.api_base + "/chat/completions"
    closed.pickers[-1].child.proc.send_signal(signal.SIGKILL)
    await closed.pickers[-1].child.proc.wait()
    async with _client() as http:
        for _ in range(5):  # fail closed: an error at once, never a hang (the client's timeout is 15 s)
            r = await http.post(url, json=_chat())
            assert r.status_code >= 500
        async with stack.picker(
            closed.workdir, closed.config, port=closed.port, name="picker-again"
        ) as again:
            closed.pickers.append(again)
            for _ in range(300):  # Envoy reconnects to the picker's port on its own
                r = await http.post(url, json=_chat())
                if r.status_code == 200:
                    break
                assert r.status_code >= 500
                await asyncio.sleep(0.1)
            assert r.status_code == 200 and r.headers["x-taogate-instance"].startswith("emu")
