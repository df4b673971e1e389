"""DNS discovery: a name resolving to several loopback addresses, changing while the gateway runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from taogate.app import create_app
from taogate.bench.procs import free_port
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.gateway import Gateway
from taogate.instance_settings import InstanceSettings
from taogate.serving import bind_socket, serve_asgi
from taogate.settings import Settings
from tests.conftest import ENV, KEY

AUTH = {"authorization": f"Bearer {KEY}"}
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


@contextlib.asynccontextmanager
async def emulators_on_one_port() -> AsyncIterator[int]:
    """One emulator on each loopback address, all on the same port (as pods behind a headless Service)."""
    for _ in range(20):
        probe = bind_socket("127.0.0.1", 0)
        port = probe.getsockname()[1]
        probe.close()
        try:
            async with contextlib.AsyncExitStack() as stack:
                for host in HOSTS:
                    cfg = EmulatorConfig(step_overhead=0.002, seed=len(host))
                    await stack.enter_async_context(run_fleet([cfg], host=host, ports=[port]))
                yield port
                return
        except OSError:
            continue
    pytest.skip("could not bind one port on three loopback addresses")


async def test_instances_join_and_leave_without_dropped_requests(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    answer = ["127.0.0.1", "127.0.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "vllm-headless.test"
        return list(answer)

    async with emulators_on_one_port() as port:
        settings = Settings(
            gateway={"shutdown_timeout": 2},
            discovery={"dns": "vllm-headless.test", "port": port, "interval": 0.1},
            dispatch={"health_check_interval": 0.2, "scrape_interval": 0.2, "warmup_tokens": 0},
        )
        app = create_app(settings, environ=ENV, resolver=resolver)
        async with serve_asgi(app) as served:
            gw = app.gateway
            assert sorted(i.name for i in gw.fleet) == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
            statuses: list[int] = []
            seen: Counter[str] = Counter()

            joined = f"127.0.0.3:{port}"

            async def load(h: httpx.AsyncClient) -> None:
                # Until the newcomer has served a few (bounded): a fast gateway may otherwise finish
                # a fixed load before the new instance is even probed.
                for i in range(2000):
                    r = await h.post(
                        served.url + "/v1/completions",
                        json={"model": "emulated-model", "prompt": f"q {i}", "max_tokens": 3},
                    )
                    statuses.append(r.status_code)
                    seen[r.headers.get("x-taogate-instance", "")] += 1
                    if seen[joined] >= 8 and i >= 60:
                        return

            async with httpx.AsyncClient(headers=AUTH, timeout=30) as h:
                task = asyncio.gather(*(load(h) for _ in range(4)))
                await asyncio.sleep(0.3)
                answer[:] = ["127.0.0.2", "127.0.0.3"]  # .1 leaves, .3 joins
                await asyncio.sleep(0.6)
                assert sorted(i.name for i in gw.fleet) == [f"127.0.0.2:{port}", joined]
                await task
            assert statuses == [200] * len(statuses) and len(statuses) >= 240
            # What dispatch saw of each instance, should the newcomer have been passed over.
            views = {
                i.name: (gw.fleet.speeds.params(i.name), i.up, i.inflight, sorted(i.models)) for i in gw.fleet
            }
            assert seen[joined] >= 8 and seen[f"127.0.0.1:{port}"] > 0, (dict(seen), len(statuses), views)
            assert gw.fleet.all_inflight() == 0
    joins = [r.getMessage() for r in caplog.records if r.getMessage().startswith("discovery ")]
    assert any("127.0.0.3" in m and "joined" in m for m in joins)


async def test_a_failing_lookup_keeps_the_instances_found_before() -> None:
    calls = 0

    async def flaky(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError("temporary failure in name resolution")
        return ["127.0.0.1"]

    settings = Settings(
        gateway={"shutdown_timeout": 2},
        discovery={"dns": "vllm.test", "port": 9, "interval": 0.05},
        dispatch={"warmup_tokens": 0},
    )
    app = create_app(settings, environ=ENV, resolver=flaky)
    async with serve_asgi(app):
        await asyncio.sleep(0.3)
        assert calls > 2
        assert [i.name for i in app.gateway.fleet] == ["127.0.0.1:9"]


async def test_a_reload_reaches_the_discovered_instances_at_once() -> None:
    """The addresses last resolved become instances under the new [discovery] section and cap
    at the reload, not at the next answer from DNS (never, while DNS fails)."""

    async def once(host: str, port: int) -> list[str]:
        return ["127.0.0.2"]

    def config(cap: int, role: str, port: int) -> Settings:
        return Settings(
            discovery={"dns": "pods.test", "port": port, "interval": 3600, "role": role},
            dispatch={"max_queue_per_instance": cap, "warmup_tokens": 0, "health_timeout": 0.2},
        )

    gw = Gateway(config(32, "any", 9), environ=ENV, resolver=once)
    try:
        await gw.discovery.resolve()
        assert gw.fleet.get("127.0.0.2:9").spec.cap == 32
        gw.reload(config(4, "short", 9))
        pod = gw.fleet.get("127.0.0.2:9")
        assert (pod.spec.cap, pod.spec.role) == (4, "short")
        gw.reload(config(4, "short", 19))  # another port: another server
        assert [i.name for i in gw.fleet] == ["127.0.0.2:19"]
        listed = config(4, "short", 19).model_copy(
            update={"instances": [InstanceSettings(url="http://127.0.0.2:19", name="listed")]}
        )
        gw.reload(listed)  # the server DNS finds is listed too: one instance, the listed one
        assert [i.name for i in gw.fleet] == ["listed"]
    finally:
        await gw.stop()


def test_dns_setting_is_a_bare_host_name() -> None:
    from taogate.config_files import load_settings
    from taogate.settings import ConfigError

    with pytest.raises(ConfigError, match="bare host name"):
        load_settings(overrides={"discovery": {"dns": "http://vllm:8000"}})


async def test_instances_that_leave_take_their_metric_series_with_them() -> None:
    answer = ["127.0.0.1", "127.0.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(answer)

    async with asyncio.timeout(60), emulators_on_one_port() as port:  # fail with a trace, not a hang
        settings = Settings(
            gateway={"shutdown_timeout": 2},
            discovery={"dns": "vllm.test", "port": port, "interval": 0.1},
            dispatch={"health_check_interval": 0.2, "warmup_tokens": 0},
        )
        app = create_app(settings, environ=ENV, resolver=resolver)
        async with serve_asgi(app) as served, httpx.AsyncClient(headers=AUTH, timeout=30) as h:
            for i in range(8):
                body = {"model": "emulated-model", "prompt": f"q {i}", "max_tokens": 2}
                assert (await h.post(served.url + "/v1/completions", json=body)).status_code == 200
            gone = f"127.0.0.1:{port}"

            def request_series(text: str, name: str) -> list[str]:
                return [ln for ln in text.splitlines() if ln.startswith("taogate_request") and name in ln]

            before = (await h.get(served.url + "/metrics")).text
            assert request_series(before, gone)  # 8 requests over 2 idle instances: both served some
            answer[:] = ["127.0.0.2"]
            for _ in range(40):
                if gone not in [i.name for i in app.gateway.fleet]:
                    break
                await asyncio.sleep(0.05)
            text = (await h.get(served.url + "/metrics")).text
            assert f'instance="{gone}"' not in text
            assert request_series(text, f"127.0.0.2:{port}")


@pytest.mark.timeout(60)
async def test_discovered_instances_publish_their_kv_events_on_their_own_address(tmp_path: Path) -> None:
    # Precise mode on a headless Service: every pod binds tcp://*:P, and the gateway subscribes to
    # port P on each address the name resolves to.
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))  # prompts are token ids: any tokenizer will do
    kv_port = free_port()
    cfg = EmulatorConfig(
        step_overhead=0.002, enable_prefix_caching=True, kv_events_endpoint=f"tcp://*:{kv_port}"
    )

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    async with run_fleet([cfg]) as fleet:
        port = int(fleet.urls[0].rsplit(":", 1)[1])
        settings = Settings(
            gateway={"shutdown_timeout": 2},
            discovery={"dns": "vllm.test", "port": port, "kv_events": f"tcp://*:{kv_port}"},
            dispatch={"health_check_interval": 0.2, "warmup_tokens": 0},
            prefill={"tokenizer": str(tmp_path / "tokenizer.json")},
        )
        app = create_app(settings, environ=ENV, resolver=resolver)
        async with serve_asgi(app) as served, httpx.AsyncClient(headers=AUTH, timeout=30) as h:
            (inst,) = list(app.gateway.fleet)
            assert inst.spec.kv_events == f"tcp://*:{kv_port}"
            for i in range(100):  # until the subscription sees what the engine stored (slow joiner)
                body = {"model": "emulated-model", "prompt": [1000 + i] * 40, "max_tokens": 1}
                assert (await h.post(served.url + "/v1/completions", json=body)).status_code == 200
                if len(inst.cache.index or ()) > 0:
                    break
                await asyncio.sleep(0.02)
            assert len(inst.cache.index or ()) > 0, "no KV event from the discovered instance"
