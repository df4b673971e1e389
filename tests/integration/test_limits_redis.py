"""Limits shared by gateway replicas through a real Redis (Debian's redis-server, started here):
the Lua script agrees with the in-process arithmetic, two replicas hold one limit, and a store that
dies, hangs or comes back is handled by ``on_store_error`` without a hung request."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.key_settings import LimitsSettings
from taogate.tenancy import store as store_module
from taogate.tenancy.fairshare import FairShare
from taogate.tenancy.keys import KeyTable, Tenant
from taogate.tenancy.limiter import Limiter
from taogate.tenancy.store import RedisStore
from taogate.tenancy.window import hit, settle
from tests.conftest import KEY, require_tool, wait_until
from tests.integration.keys_helpers import (
    MODEL,
    SECRETS,
    RedisServer,
    chat,
    chat_once,
    keyed_gateway,
    keyed_settings,
    sdk,
)

TEAM_A = {"name": "team-a", "key_env": "TEAM_A_KEY"}


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(require_tool("redis-server", hint="apt-get install redis-server"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.pause(False)
        server.kill()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 4_000),
            st.integers(0, 300),
            st.integers(-200, 200),
            st.sampled_from([1_000, 2_500]),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_the_lua_script_counts_exactly_as_the_python_window(
    redis_server: RedisServer, steps: list[tuple[int, int, int, int]]
) -> None:
    """The same checks and settlements, at the same times, give the same counts in both, a window
    reloaded to another length included."""

    async def run() -> None:
        store = RedisStore(redis_server.url, timeout=2.0, prefix=f"t{time.monotonic_ns()}:")
        state = None
        now = 1_000_000
        try:
            for advance, cost, correction, window in steps:
                now += advance
                got = await store.hit("k", window, rpm=5, tpm=600, cost=cost, now_ms=now)
                state, want = hit(state, now, window, rpm=5, tpm=600, cost=cost)
                assert got == want
                if got.admitted and correction:
                    await store.settle("k", got.bucket, correction)
                    settle(state, got.bucket, correction)
        finally:
            await store.aclose()

    asyncio.run(run())


async def admitted_over(urls: list[str], seconds: float, rate: float) -> tuple[int, int]:
    """Requests sent to the gateways in turn at ``rate`` per second for ``seconds``: (admitted, sent)."""
    ok = sent = 0
    async with httpx.AsyncClient(
        timeout=10, headers={"authorization": f"Bearer {SECRETS['TEAM_A_KEY']}"}
    ) as h:
        start = time.monotonic()
        tasks = []

        async def one(url: str) -> int:
            body = {"model": "emulated-model", "prompt": "hi", "max_tokens": 1}
            return (await h.post(url + "/v1/completions", json=body)).status_code

        while (elapsed := time.monotonic() - start) < seconds:
            tasks.append(asyncio.create_task(one(urls[sent % len(urls)])))
            sent += 1
            await asyncio.sleep(max(0.0, sent / rate - elapsed))
        codes = await asyncio.gather(*tasks)
    ok = sum(c == 200 for c in codes)
    assert set(codes) <= {200, 429}, codes
    return ok, sent


async def test_two_replicas_hold_one_shared_limit(redis_server: RedisServer) -> None:
    """40 requests per 4 s window, offered at twice that rate through two replicas in turn: over the
    three windows after a first one, within 10% of the 120 the limit allows (two replicas counting
    apart would admit twice as many)."""
    async with run_fleet([EmulatorConfig(seed=0, instant=True)]) as fleet:
        keys = [{**TEAM_A, "requests_per_minute": 40}]
        # A store timeout for a test process whose one event loop runs both replicas and the load.
        limits = {"store": redis_server.url, "window": 4.0, "store_timeout": 1.0}
        settings_ = keyed_settings(fleet.urls, keys, limits)
        async with keyed_gateway(settings_) as a, keyed_gateway(settings_) as b:
            await admitted_over([a.url, b.url], 4.0, 20.0)  # the first window: fill it
            ok, sent = await admitted_over([a.url, b.url], 12.0, 20.0)
            assert a.gateway.limiter.store_up and b.gateway.limiter.store_up
    assert sent >= 1.5 * 120  # the limit binds
    assert 0.9 * 120 <= ok <= 1.1 * 120, (ok, sent)


async def test_redis_killed_and_restarted_under_fail_open(redis_server: RedisServer) -> None:
    async with run_fleet([EmulatorConfig(seed=0, instant=True)]) as fleet:
        limits = {"store": redis_server.url, "store_timeout": 0.2, "on_store_error": "fail_open"}
        settings_ = keyed_settings(fleet.urls, [{**TEAM_A, "requests_per_minute": 3}], limits)
        async with keyed_gateway(settings_) as gw:
            limiter = gw.gateway.limiter
            for _ in range(3):
                await chat_once(gw, SECRETS["TEAM_A_KEY"])
            with pytest.raises(openai.RateLimitError):
                await chat_once(gw, SECRETS["TEAM_A_KEY"])
            redis_server.kill()
            for _ in range(3):  # the store is gone: admitted, without limits
                raw = await chat_once(gw, SECRETS["TEAM_A_KEY"])
                assert "x-ratelimit-limit-requests" not in raw.headers
            assert not limiter.store_up
            async with httpx.AsyncClient() as h:
                assert "taogate_limits_store_up 0.0" in (await h.get(gw.url + "/metrics")).text
            redis_server.start()  # empty: the counts start again
            await asyncio.sleep(1.1)  # the failed store is tried again after a second
            for left in (2, 1, 0):
                raw = await chat_once(gw, SECRETS["TEAM_A_KEY"])
                assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
            assert limiter.store_up
            with pytest.raises(openai.RateLimitError):
                await chat_once(gw, SECRETS["TEAM_A_KEY"])


async def test_redis_killed_and_restarted_under_fail_closed(redis_server: RedisServer) -> None:
    async with run_fleet([EmulatorConfig(seed=0, instant=True)]) as fleet:
        limits = {"store": redis_server.url, "store_timeout": 0.2, "on_store_error": "fail_closed"}
        settings_ = keyed_settings(fleet.urls, [{**TEAM_A, "requests_per_minute": 100}], limits)
        async with keyed_gateway(settings_) as gw:
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
            redis_server.kill()
            for _ in range(2):
                with pytest.raises(openai.InternalServerError) as refused:
                    await chat_once(gw, SECRETS["TEAM_A_KEY"])
                assert refused.value.status_code == 503
                assert refused.value.code == "limits_store_unavailable"
            await chat_once(gw, KEY)  # a key without rate limits does not need the store
            redis_server.start()
            await asyncio.sleep(1.1)
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
            assert gw.gateway.limiter.stats["team-a"].rejections == {"store_unavailable": 2}


async def test_a_restarted_redis_fails_no_request_on_the_connections_from_before(
    redis_server: RedisServer,
) -> None:
    """After a restart every pooled connection is dead: each failed one call as it came up (a burst
    of 8 saw 7 failures) before a broken connection was retried once at once."""
    store = RedisStore(redis_server.url, timeout=0.5)
    try:

        async def hit_once() -> None:
            await store.hit("team-a", 60_000, rpm=1_000, tpm=0, cost=1)

        await asyncio.gather(*(hit_once() for _ in range(8)))  # eight pooled connections
        redis_server.kill()
        redis_server.start()
        await hit_once()
        await asyncio.gather(*(hit_once() for _ in range(8)))
    finally:
        await store.aclose()


async def test_a_hung_store_delays_no_request_past_the_store_timeout(redis_server: RedisServer) -> None:
    async with run_fleet([EmulatorConfig(seed=0, instant=True)]) as fleet:
        limits = {"store": redis_server.url, "store_timeout": 0.2}
        settings_ = keyed_settings(fleet.urls, [{**TEAM_A, "requests_per_minute": 100}], limits)
        async with keyed_gateway(settings_) as gw:
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
            redis_server.pause(True)  # accepts connections, answers nothing
            try:
                took = []
                for _ in range(4):
                    start = time.monotonic()
                    await chat_once(gw, SECRETS["TEAM_A_KEY"])
                    took.append(time.monotonic() - start)
            finally:
                redis_server.pause(False)
            assert not gw.gateway.limiter.store_up
            # The first waits out the timeout; the next ones skip the failed store for a second.
            assert max(took) < 0.2 + 1.0, took
            assert sorted(took)[0] < 0.2, took
            await asyncio.sleep(1.1)
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
            await wait_until(lambda: gw.gateway.limiter.store_up, what="the store back")


async def test_two_replicas_hold_one_max_concurrency_and_a_dead_replicas_leases_lapse(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_concurrency 2 across two replicas: with two streams open through one (renewed past their
    leases' life), a request through the other is refused until one of them ends; leases left by a
    replica that stopped lapse."""
    monkeypatch.setattr(store_module, "LEASE_TTL_MS", 1_500)
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:  # 12 ms a step: 400 tokens take seconds
        keys = [{**TEAM_A, "max_concurrency": 2}]
        settings_ = keyed_settings(fleet.urls, keys, {"store": redis_server.url, "store_timeout": 1.0})
        async with (
            keyed_gateway(settings_) as a,
            keyed_gateway(settings_) as b,
            sdk(a, SECRETS["TEAM_A_KEY"]) as via_a,
            sdk(b, SECRETS["TEAM_A_KEY"]) as via_b,
        ):
            streams = []
            for _ in range(2):
                stream = await via_a.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=400, stream=True
                )
                await anext(aiter(stream))  # the first chunk: the request is in flight
                streams.append(stream)
            for _ in range(5):  # past the leases' 1.5 s: renewed by their replica, so still held
                await a.gateway.limiter.renew()
                await asyncio.sleep(0.4)
            with pytest.raises(openai.RateLimitError, match="in flight"):
                await chat(via_b)
            assert b.gateway.limiter.stats["team-a"].rejections == {"concurrency": 1}
            await streams[0].close()  # a client that hangs up: its lease goes back
            await wait_until(lambda: a.gateway.limiter.stats["team-a"].in_flight == 1, what="released")
            for _ in range(50):  # bounded: the lease is removed just after the release
                try:
                    assert (await chat(via_b)).http_response.status_code == 200
                    break
                except openai.RateLimitError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("the released lease was not given back")
            await streams[1].close()
            await wait_until(lambda: a.gateway.limiter.stats["team-a"].in_flight == 0, what="released")

            # A replica that stopped while holding both leases: they lapse, never renewed.
            stopped = RedisStore(redis_server.url, timeout=1.0)
            for n in range(2):
                took = await stopped.hit(
                    "team-a", 60_000, rpm=0, tpm=0, cost=0, lease=f"stopped:{n}", max_concurrency=2
                )
                assert took.admitted
            await stopped.aclose()
            with pytest.raises(openai.RateLimitError, match="in flight"):
                await chat(via_b)
            await asyncio.sleep(1.6)
            assert (await chat(via_b)).http_response.status_code == 200


@contextlib.asynccontextmanager
async def _two_replicas(redis_server: RedisServer, on_store_error: str) -> AsyncIterator[Any]:
    """Two gateways sharing ``redis_server`` for team-a's max_concurrency of 1, and an SDK client of
    each: (a, b, via_a, via_b). The emulator takes 12 ms a step: 400 tokens take seconds."""
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "max_concurrency": 1}]
        limits = {"store": redis_server.url, "store_timeout": 0.3, "on_store_error": on_store_error}
        settings_ = keyed_settings(fleet.urls, keys, limits)
        async with (
            keyed_gateway(settings_) as a,
            keyed_gateway(settings_) as b,
            sdk(a, SECRETS["TEAM_A_KEY"]) as via_a,
            sdk(b, SECRETS["TEAM_A_KEY"]) as via_b,
        ):
            yield a, b, via_a, via_b


async def test_leases_the_store_lost_while_down_are_added_back(redis_server: RedisServer) -> None:
    """max_concurrency 1 across two replicas, its slot held through one; Redis restarts empty. That
    replica's next renewal adds its lease back, so the other refuses until the request ends (it
    would admit a second one otherwise)."""
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    async with _two_replicas(redis_server, "fail_closed") as (a, _, via_a, via_b):
        stream = await via_a.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=400, stream=True
        )
        await anext(aiter(stream))  # the first chunk: the request is in flight
        redis_server.kill()
        await a.gateway.limiter.renew()  # the store is gone: its lease may be lost
        assert not a.gateway.limiter.store_up
        redis_server.start()  # empty
        await asyncio.sleep(1.1)  # the failed store is tried again after a second
        await a.gateway.limiter.renew()
        assert a.gateway.limiter.store_up
        for _ in range(3):  # bounded: b may find out the store restarted on its call (503)
            try:
                await chat(via_b)
            except openai.InternalServerError:
                await asyncio.sleep(1.1)
                continue
            except openai.RateLimitError as exc:
                assert "in flight" in str(exc)
                break
            raise AssertionError("admitted past max_concurrency: the lease was not added back")
        else:
            raise AssertionError("the store never answered the other replica")
        await stream.close()


async def test_a_request_admitted_while_the_store_was_down_holds_its_slot_once_it_is_back(
    redis_server: RedisServer,
) -> None:
    """Admitted through one replica under fail_open while Redis is down, a stream took no lease:
    once Redis is back, the other replica admitted a second one past max_concurrency 1. Its lease
    is added by the first replica's next renewal now, and an idle replica sees the store back."""
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    async with _two_replicas(redis_server, "fail_open") as (a, b, via_a, via_b):
        await chat(via_b)  # b has talked to the store once
        redis_server.kill()
        stream = await via_a.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=400, stream=True
        )
        await anext(aiter(stream))  # admitted without the store
        assert not a.gateway.limiter.store_up
        redis_server.start()
        await asyncio.sleep(1.1)  # the failed store is tried again after a second
        await a.gateway.limiter.renew()
        assert a.gateway.limiter.store_up
        with pytest.raises(openai.RateLimitError, match="in flight"):
            await chat(via_b)
        await stream.close()
        redis_server.kill()
        await chat(via_b)  # b finds the store gone (fail_open: admitted) ...
        assert not b.gateway.limiter.store_up
        redis_server.start()
        await asyncio.sleep(1.1)
        await b.gateway.limiter.renew()  # ... and, holding nothing, asks whether it is back
        assert b.gateway.limiter.store_up


class CountedStore(RedisStore):
    """A Redis store at a closed port (every call refused), counting its checks."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        super().__init__(f"redis://127.0.0.1:{port}", timeout=0.5)
        self.calls = 0

    async def hit(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await super().hit(*args, **kwargs)


async def test_a_failed_store_is_tried_by_one_request_a_second_not_by_all() -> None:
    clock = [1000.0]
    team = Tenant("team", requests_per_minute=100)
    store = CountedStore()
    table = KeyTable(Tenant("unified"), {b"t" * 32: team})
    limiter = Limiter(table, LimitsSettings(), clock=lambda: clock[0], fair=FairShare(), store=store)
    try:
        await limiter.check(team, None, 1)  # fail open: admitted, the store marked down
        assert (store.calls, limiter.store_up) == (1, False)
        clock[0] += 2.0  # past the retry time: many requests at once
        await asyncio.gather(*(limiter.check(team, None, 1) for _ in range(8)))
        assert store.calls == 2
    finally:
        await store.aclose()


async def test_a_burst_while_the_store_hangs_stays_within_the_key_s_concurrency(
    redis_server: RedisServer,
) -> None:
    """The requests of a burst each wait on a hung store (then fail open): this replica's own
    count of the key's requests in flight still holds them to ``max_concurrency``."""
    team = Tenant("team", requests_per_minute=100, max_concurrency=2)
    table = KeyTable(Tenant("unified"), {b"t" * 32: team})
    store = RedisStore(redis_server.url, timeout=0.2)
    limits = LimitsSettings(store=redis_server.url, store_timeout=0.2)
    limiter = Limiter(table, limits, clock=time.monotonic, fair=FairShare(), store=store)
    try:
        await limiter.check(team, None, 1)  # the store answers: one in flight
        redis_server.pause(True)
        try:
            tries = await asyncio.gather(
                *(limiter.check(team, None, 1) for _ in range(10)), return_exceptions=True
            )
        finally:
            redis_server.pause(False)
        admitted = [t for t in tries if not isinstance(t, BaseException)]
        assert len(admitted) == 1, tries  # the second slot; the other nine refused
        assert limiter.stats["team"].in_flight == 2
    finally:
        await limiter.aclose()
        await store.aclose()
