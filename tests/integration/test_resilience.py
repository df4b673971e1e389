"""Chaos on 127.0.0.1: instances that hang, fail, break streams, die and come back; clients that
hang up. Nothing is lost: no failed request that another instance could serve, no leaked slot."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from taogate.emulator.config import EmulatorConfig
from taogate.serving import bind_socket
from tests.conftest import KEY, GatewayFactory, Running, running_gateway, wait_until

MODEL = "emulated-model"
AUTH = {"authorization": f"Bearer {KEY}"}
FAST_RETRY = {"retry": {"backoff_base": 0.01, "backoff_max": 0.05, "budget_ratio": 0.5}}


def fleet(n: int, **kw: Any) -> list[EmulatorConfig]:
    return [EmulatorConfig(seed=i, step_overhead=0.002, **kw) for i in range(n)]


def body(i: int, stream: bool = False, max_tokens: int = 2, words: int = 0) -> dict[str, Any]:
    """Request ``i``: a tiny prompt, or one of about ``words`` more tokens (unique from its start)."""
    prompt = f"request {i} hello" + " word" * words
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def run_load(gw: Running, n: int, concurrency: int, stream: bool = False, words: int = 0) -> list[int]:
    sem = asyncio.Semaphore(concurrency)

    async def one(h: httpx.AsyncClient, i: int) -> int:
        async with sem:
            if not stream:
                return (await h.post(gw.api_base + "/completions", json=body(i, words=words))).status_code
            async with h.stream("POST", gw.api_base + "/completions", json=body(i, True, words=words)) as r:
                data = b"".join([c async for c in r.aiter_bytes()])
                return r.status_code if data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data else 599

    async with httpx.AsyncClient(headers=AUTH, timeout=30) as h:
        return list(await asyncio.gather(*(one(h, i) for i in range(n))))


def assert_nothing_leaked(gw: Running) -> None:
    for inst in gw.gateway.fleet:
        assert (inst.inflight, inst.prefilling, inst.prefill_tokens) == (0, 0, 0), inst.name
    assert gw.gateway.dispatcher.queued == 0


def _established_at(port: int) -> int:
    """Established loopback TCP connections whose local port is ``port``: a server's ends."""
    rows = (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
    return sum(1 for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "01")


async def wait_for(predicate: Any, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_a_hung_instance_is_failed_over_then_ejected(gateway_factory: GatewayFactory) -> None:
    dispatch = {**FAST_RETRY, "breaker_failures": 2, "breaker_cooldown": 30.0}
    async with gateway_factory(fleet(3), gateway={"request_timeout": 0.5}, dispatch=dispatch) as gw:
        gw.fleet.instances[0].faults.hang = True
        statuses: list[int] = []
        # Rounds of long prompts: each starts with i0 idle, and the prefill queued at the others
        # (not a few milliseconds' difference of learned pace) makes it tried until the breaker opens.
        for _ in range(6):
            statuses += await run_load(gw, 6, 3, words=2000)
        assert statuses == [200] * 36
        i0 = gw.gateway.fleet.get("i0")
        assert i0.breaker.state(gw.gateway.clock()).value == "open"
        assert gw.fleet.instances[0].stats()["requests_seen"] == 2  # the breaker keeps new work away
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(gw.url + "/metrics")).text
        assert 'taogate_retries_total{instance="i0",reason="read_timeout"}' in metrics
        assert_nothing_leaked(gw)


async def test_five_percent_500s_are_invisible_to_clients(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(fleet(3), dispatch={**FAST_RETRY, "breaker_failures": 50}) as gw:
        gw.fleet.instances[1].faults.error_rate = 0.05
        statuses = await run_load(gw, 200, 16)
        assert statuses.count(200) == 200
        errors = gw.fleet.instances[1].stats()["errors"]
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(gw.url + "/metrics")).text
        retried = sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("taogate_retries_total{")
        )
        assert retried == errors  # every upstream 500 was retried once, elsewhere
        assert_nothing_leaked(gw)


async def test_an_instance_that_always_fails_is_ejected_and_clients_never_see_it(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(fleet(2), dispatch={**FAST_RETRY, "breaker_failures": 3}) as gw:
        gw.fleet.instances[0].faults.error_rate = 1.0
        assert await run_load(gw, 40, 4) == [200] * 40
        assert gw.fleet.instances[0].stats()["errors"] <= 6  # ejected after a few failures
        assert_nothing_leaked(gw)


async def test_a_failed_attempt_counts_against_its_instance_and_not_against_what_follows(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """i0 fails every request, i1 is held at its cap: a request fails on i0, waits for i1 until
    the queue's timeout, and ends in a 429 that is neither i0's nor free of its wait; a request
    that fails over and succeeds carries no error of the attempt before."""
    dispatch = {**FAST_RETRY, "breaker_failures": 50, "max_queue_per_instance": 1, "queue_timeout": 0.5}
    async with gateway_factory(fleet(2), dispatch=dispatch) as gw:
        failing, held = gw.fleet.instances
        failing.faults.error_rate = 1.0
        held.faults.slow_first_byte = 3.0
        caplog.set_level(logging.INFO, "taogate.access")
        async with httpx.AsyncClient(headers=AUTH, timeout=30) as h:
            holding = asyncio.create_task(h.post(gw.api_base + "/completions", json=body(0)))
            await wait_until(lambda: gw.gateway.fleet.get("i1").inflight == 1, 5, "i1 held")
            refused = await h.post(gw.api_base + "/completions", json=body(1))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_timeout"
            assert (await holding).status_code == 200
            held.faults.slow_first_byte = 0.0
            served = [await h.post(gw.api_base + "/completions", json=body(i)) for i in range(2, 8)]
            metrics = (await h.get(gw.url + "/metrics")).text
        assert [r.status_code for r in served] == [200] * 6
        lines = [r.getMessage() for r in caplog.records if r.name == "taogate.access"]
        (line,) = [line for line in lines if "status=429" in line]
        assert "instance=" not in line and "error=queue_timeout" in line and "retries=1" in line
        assert float(line.split("queue_wait=")[1].split()[0]) >= 0.5
        wait_count = [m for m in metrics.splitlines() if m.startswith("taogate_queue_wait_seconds_count")]
        assert wait_count and float(wait_count[0].split()[-1]) >= 1, wait_count
        retried = [line for line in lines if "status=200" in line and "retries=1" in line]
        assert retried and all("error=" not in line for line in retried), retried
        window = gw.gateway.fleet.get("i0").window.stats(gw.gateway.clock())
        assert window.errors >= 1 + len(retried)
        assert_nothing_leaked(gw)


async def test_a_stream_broken_mid_way_ends_cleanly_with_an_error_event(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(fleet(1)) as gw:
        gw.fleet.instances[0].faults.close_mid_stream = 2
        async with (
            httpx.AsyncClient(headers=AUTH, timeout=10) as h,
            h.stream("POST", gw.api_base + "/completions", json=body(1, True, 20)) as r,
        ):
            data = b"".join([c async for c in r.aiter_bytes()])
        assert r.status_code == 200
        assert b'"code":"upstream_stream_broken"' in data and data.endswith(b"data: [DONE]\n\n")
        # The error event starts on an event boundary, and the failure counts against the instance
        # (not reset by the 200 that went out first).
        assert b'\n\ndata: {"error"' in data or data.startswith(b'data: {"error"')
        assert gw.gateway.fleet.get("i0").breaker.consecutive_failures == 1
        assert_nothing_leaked(gw)


async def test_a_stalled_stream_is_ended_by_the_idle_timeout(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(fleet(1), gateway={"stream_idle_timeout": 0.3}) as gw:
        gw.fleet.instances[0].faults.latency_spike = 1.5
        async with (
            httpx.AsyncClient(headers=AUTH, timeout=10) as h,
            h.stream("POST", gw.api_base + "/completions", json=body(1, True, 20)) as r,
        ):
            data = b"".join([c async for c in r.aiter_bytes()])
        assert b'"code":"stream_idle_timeout"' in data and data.endswith(b"data: [DONE]\n\n")
        await wait_for(lambda: gw.fleet.instances[0].stats()["in_flight"] == 0)
        assert_nothing_leaked(gw)


async def test_a_client_that_stops_reading_is_dropped_and_frees_its_slot(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that keeps its connection open but reads nothing would hold the instance slot for
    ever: past client_stall_timeout the gateway aborts the instance request and frees the slot. It
    says so in a warning, and the server's ERROR about the unfinished response is not logged."""
    async with gateway_factory(fleet(1, instant=True), gateway={"client_stall_timeout": 0.3}) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        payload = json.dumps(body(1, True, 30_000)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        )
        try:
            await asyncio.get_running_loop().sock_sendall(sock, head.encode() + payload)
            # ... and never read: the gateway's send blocks once the buffers are full.
            await wait_for(lambda: gw.gateway.fleet.get("i0").inflight == 1)
            await wait_for(lambda: gw.gateway.fleet.get("i0").inflight == 0, seconds=20)
            # (vLLM may have finished generating into the buffers by then: what matters is the slot.)
            await wait_for(lambda: gw.fleet.instances[0].stats()["in_flight"] == 0)
            text = generate_latest(gw.gateway.registry).decode()
            assert "taogate_client_disconnects_total 1.0" in text
            await wait_for(lambda: any("client dropped" in r.getMessage() for r in caplog.records))
            # The gateway's end of the connection is gone too, not left open behind what the client
            # never read (a close waits for it to be read: such connections filled the cap).
            await wait_for(lambda: _established_at(port) == 0)
        finally:
            sock.close()
        assert_nothing_leaked(gw)
    [warning] = [r for r in caplog.records if "client dropped" in r.getMessage()]
    assert warning.levelname == "WARNING" and "read nothing for 0.3s" in warning.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_client_that_pipelines_whole_answers_and_reads_none_is_dropped(
    gateway_factory: GatewayFactory,
) -> None:
    """A whole answer's write has no stream relay to watch it: once the buffers are full, the
    next answer's write would wait for ever, its slot held. The listener drops the client."""
    async with gateway_factory(fleet(1, instant=True), gateway={"client_stall_timeout": 0.3}) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        payload = json.dumps(body(1, False, 30_000)).encode()
        one = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        try:
            await loop.sock_sendall(sock, one * 20)  # ... and never read
            await wait_for(lambda: gw.gateway.fleet.get("i0").inflight == 1)
            await wait_for(lambda: _established_at(port) == 0, seconds=20)
            await wait_for(lambda: gw.gateway.fleet.get("i0").inflight == 0)
        finally:
            sock.close()
        assert_nothing_leaked(gw)


async def test_randomized_disconnects_and_timeouts_leak_nothing(gateway_factory: GatewayFactory) -> None:
    rng = random.Random(7)
    async with gateway_factory(fleet(3), dispatch={"max_queue_per_instance": 4, "queue_size": 1000}) as gw:

        async def one(h: httpx.AsyncClient, i: int) -> None:
            timeout = rng.uniform(0.005, 0.25)
            try:
                if rng.random() < 0.5:
                    async with h.stream(
                        "POST", gw.api_base + "/completions", json=body(i, True, 50), timeout=timeout
                    ) as r:
                        async for _ in r.aiter_bytes():
                            if rng.random() < 0.3:
                                break  # hang up mid-stream
                else:
                    await h.post(gw.api_base + "/completions", json=body(i, False, 30), timeout=timeout)
            except httpx.HTTPError:
                pass

        async def worker(ids: range) -> None:
            async with httpx.AsyncClient(headers=AUTH) as h:
                for i in ids:
                    await one(h, i)

        await asyncio.gather(*(worker(range(w, 1000, 25)) for w in range(25)))
        await wait_for(lambda: all(inst.inflight == 0 for inst in gw.gateway.fleet), 15)
        await wait_for(lambda: all(e.stats()["in_flight"] == 0 for e in gw.fleet.instances), 15)
        assert_nothing_leaked(gw)
        assert sum(e.stats()["aborted"] for e in gw.fleet.instances) > 20
        assert all(e.stats()["running"] == 0 and e.stats()["waiting"] == 0 for e in gw.fleet.instances)
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(gw.url + "/metrics")).text
        assert "taogate_client_disconnects_total" in metrics


async def test_reload_under_load_fails_no_request(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(fleet(3)) as gw:
        g = gw.gateway
        original = g.settings
        load = asyncio.create_task(run_load(gw, 150, 8))
        for step in range(6):
            await asyncio.sleep(0.05)
            instances = [i.model_dump() for i in original.instances]
            keep = instances if step % 2 else instances[:2]  # drop i2, then bring it back
            g.reload(
                original.model_copy(update={"instances": [type(original.instances[0])(**i) for i in keep]})
            )
        assert await load == [200] * 150
        await wait_for(lambda: g.fleet.all_inflight() == 0)
        assert_nothing_leaked(gw)
        learning = g.accounting._learning
        g.reload(original)
        assert g.accounting._learning is learning  # when each model last calibrated, kept


async def test_a_removed_instance_s_last_answer_teaches_no_speed(gateway_factory: GatewayFactory) -> None:
    """A request still running on an instance the reload removed ends well, and its answer does not
    bring the instance back into the speed estimator, where it would skew the fleet's median."""
    async with (
        gateway_factory(fleet(2), gateway={"request_timeout": 30}) as gw,
        httpx.AsyncClient(headers=AUTH, timeout=30) as h,
    ):
        g = gw.gateway
        original = g.settings
        running = asyncio.create_task(h.post(gw.api_base + "/completions", json=body(1, True, 40)))
        await wait_for(lambda: g.fleet.all_inflight() == 1)
        busy = next(i.name for i in g.fleet if i.inflight)
        keep = [i for i in original.instances if i.label != busy]
        g.reload(original.model_copy(update={"instances": keep}))
        assert busy not in g.fleet.speeds.snapshot()
        assert (await running).status_code == 200
        await wait_for(lambda: g.fleet.all_inflight() == 0)
        assert busy not in g.fleet.speeds.snapshot()


async def _spawn_emulator(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "taogate.emulator",
        "--port",
        str(port),
        "--step-overhead",
        "0.002",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert b"emulator ready" in line, line
    return proc


@pytest.mark.slow
async def test_killing_an_instance_mid_load_loses_no_request() -> None:
    ports = []
    for _ in range(3):
        s = bind_socket("127.0.0.1", 0)
        ports.append(s.getsockname()[1])
        s.close()
    procs = [await _spawn_emulator(p) for p in ports]
    from taogate.app import create_app
    from taogate.serving import serve_asgi
    from tests.conftest import ENV, gateway_settings

    try:
        settings = gateway_settings(
            [f"http://127.0.0.1:{p}" for p in ports],
            dispatch={**FAST_RETRY, "health_check_interval": 0.3, "unhealthy_after": 1},
        )
        app = create_app(settings, environ=ENV)
        async with serve_asgi(app) as served:
            gw = app.gateway
            sem = asyncio.Semaphore(16)
            results: list[int] = []

            async def one(h: httpx.AsyncClient, i: int) -> None:
                async with sem:
                    r = await h.post(served.url + "/v1/completions", json=body(i, False, 8))
                    results.append(r.status_code)

            async with httpx.AsyncClient(headers=AUTH, timeout=30) as h:
                load = asyncio.gather(*(one(h, i) for i in range(200)))
                await wait_for(lambda: len(results) >= 50)
                procs[0].send_signal(signal.SIGKILL)
                await procs[0].wait()
                await load
                assert results == [200] * 200
                await wait_for(lambda: not gw.fleet.get("i0").up, 2.0)  # ejected within a probe interval
                procs[0] = await _spawn_emulator(ports[0])
                await wait_for(lambda: gw.fleet.get("i0").up, 5.0)  # readmitted after restart
                r = await h.post(served.url + "/v1/completions", json=body(0))
                assert r.status_code == 200
            assert gw.fleet.all_inflight() == 0
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await p.wait()


async def test_graceful_stop_finishes_in_flight_and_refuses_new_work() -> None:
    """Graceful stop: in-flight requests finish; new ones are refused with 503."""
    async with (
        running_gateway(fleet(1), dispatch={"max_queue_per_instance": 1}) as gw,
        httpx.AsyncClient(headers=AUTH, timeout=10) as h,
    ):
        slow = asyncio.create_task(h.post(gw.api_base + "/completions", json=body(1, False, 40)))
        await wait_for(lambda: gw.gateway.fleet.get("i0").inflight == 1)
        stopping = asyncio.create_task(gw.gateway.stop())
        await asyncio.sleep(0.05)
        r = await h.post(gw.api_base + "/completions", json=body(2))
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert (await slow).status_code == 200
        await stopping


async def test_an_exhausted_connection_pool_is_a_503_and_never_blames_the_instance(
    gateway_factory: GatewayFactory,
) -> None:
    """max_connections below the instances' caps (the article's own config: 64 against 2 x 64):
    a request that waits past the pool timeout for a connection gets a 503 naming the setting, and
    the instance, which is fine, keeps its breaker closed."""
    dispatch = {**FAST_RETRY, "breaker_failures": 1, "breaker_cooldown": 30.0}
    gateway = {"max_connections": 1, "request_timeout": 0.5}
    async with gateway_factory(fleet(1), gateway=gateway, dispatch=dispatch) as gw:
        stream = body(0, True, max_tokens=600)
        async with (
            httpx.AsyncClient(headers=AUTH, timeout=30) as h,
            h.stream("POST", gw.api_base + "/completions", json=stream) as long,
        ):
            assert long.status_code == 200
            refused = await h.post(gw.api_base + "/completions", json=body(1))
            data = b"".join([c async for c in long.aiter_bytes()])
        assert data.endswith(b"data: [DONE]\n\n")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "max_connections" in refused.json()["error"]["message"]
        i0 = gw.gateway.fleet.get("i0")
        assert i0.breaker.state(gw.gateway.clock()).value == "closed"
        assert (await run_load(gw, 3, 1)) == [200, 200, 200]
        assert_nothing_leaked(gw)
