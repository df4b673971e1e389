"""The KV-events subscription's life: a wildcard publisher reached on the instance's host, a bad
batch that starts the index over without ending it, a subscription that ends taking its index
with it, a re-subscription on the same bound port, and a removed ``kv_events`` that stops the index.
The publisher is the emulator's (vLLM's wire) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import pytest

from taogate.bench.procs import free_port
from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import block_stored
from taogate.emulator.kv_events import KvEventPublisher
from taogate.fleet.instance import Instance, InstanceSpec
from tests.conftest import wait_until

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
from taogate.control.kv_events import BIND_BACKOFF, KvEventsSubscriber

TOKENS = list(range(64))
HASHES = block_hashes(TOKENS, 16)


def _instance(kv_events: str, replay: str | None = None) -> Instance:
    spec = InstanceSpec("i0", "http://127.0.0.1:1", kv_events=kv_events, kv_events_replay=replay)
    return Instance(spec, unhealthy_after=2, healthy_after=1, breaker_failures=5, breaker_cooldown=1.0)


def _block(i: int) -> dict[str, object]:
    return block_stored(HASHES[i : i + 1], HASHES[i - 1] if i else None, TOKENS[16 * i : 16 * i + 16], 16)


async def _until_seen(publisher: KvEventPublisher, inst: Instance, i: int = 0) -> None:
    """Publish block ``i`` until the index has it (ZMQ's slow joiner loses the first ones)."""
    for _ in range(400):
        publisher.publish([_block(i)])
        await asyncio.sleep(0.01)
        index = inst.cache.index
        if index is not None and index.cached_run(HASHES[i : i + 1]) == 1:
            return
    raise AssertionError("the subscriber never saw the publisher's events")


@pytest.mark.timeout(20)
async def test_a_wildcard_publisher_is_reached_on_the_instance_host_and_bad_batches_are_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    publisher = KvEventPublisher(f"tcp://*:{port}")  # vLLM's default form: it binds
    inst = _instance(f"tcp://*:{port}")
    subscriber = KvEventsSubscriber([inst])
    caplog.set_level(logging.INFO, "taogate.health")
    try:
        subscriber.sync()
        await _until_seen(publisher, inst)
        index = inst.cache.index
        assert index is not None
        for _ in range(2):  # a malformed event, twice: said once, and the index starts over each time
            publisher.publish([{"type": "BlockStored", "block_hashes": 5, "block_size": 16}])
        await wait_until(lambda: len(index) == 0, what="the index started over")
        publisher.publish([_block(1)])
        await wait_until(lambda: len(index) == 1, what="later batches still applied")
        assert inst.cache.index is index and len(subscriber) == 1
        assert sum("degraded, unreadable batch" in r.getMessage() for r in caplog.records) == 1
        # A malformed batch after a gap: its number is looked at first, then its events.
        publisher._seq += 5
        publisher.publish([{"type": "BlockStored", "block_hashes": 5, "block_size": 16}])
        publisher.publish([_block(2)])
        await wait_until(lambda: index.cached_run(HASHES[2:3]) == 1, what="batches after it applied")
        assert inst.cache.index is index and len(subscriber) == 1
    finally:
        await subscriber.stop()
        await publisher.aclose()
    assert inst.cache.index is None


@pytest.mark.timeout(20)
async def test_a_subscription_that_fails_takes_its_index_with_it(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    inst = _instance(endpoint)
    subscriber = KvEventsSubscriber([inst])
    publisher = KvEventPublisher(endpoint)  # vLLM's form for an address: it connects, we bind

    async def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    subscriber._batch = broken  # type: ignore[method-assign]
    try:
        subscriber.sync()
        await wait_until(lambda: inst.cache.index is not None, what="subscribed")
        for _ in range(400):
            publisher.publish([_block(0)])
            await asyncio.sleep(0.01)
            if inst.cache.index is None:
                break
        assert inst.cache.index is None  # dispatch uses the approximate model
        assert any("subscription failed" in r.getMessage() for r in caplog.records)
    finally:
        await subscriber.stop()
        await publisher.aclose()


@pytest.mark.timeout(30)
async def test_re_subscribing_on_the_same_port_and_unsubscribing() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    inst = _instance(endpoint)
    subscriber = KvEventsSubscriber([inst])
    publisher = KvEventPublisher(endpoint)
    try:
        subscriber.sync()
        await _until_seen(publisher, inst)
        first = inst.cache.index
        # only the replay endpoint changes: the same port is bound again at once
        inst.spec = dataclasses.replace(inst.spec, kv_events_replay=f"tcp://127.0.0.1:{free_port()}")
        subscriber.sync()
        await wait_until(lambda: inst.cache.index not in (None, first), what="subscribed again")
        await _until_seen(publisher, inst, 1)
        # kv_events removed: the index stops being used
        inst.spec = dataclasses.replace(inst.spec, kv_events=None, kv_events_replay=None)
        subscriber.sync()
        await wait_until(lambda: inst.cache.index is None, what="index dropped")
        assert len(subscriber) == 0
    finally:
        await subscriber.stop()
        await publisher.aclose()


@pytest.mark.timeout(30)
async def test_a_bind_that_failed_is_retried_at_the_next_sync() -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    inst = _instance(endpoint)
    subscriber = KvEventsSubscriber([inst])
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        subscriber.sync()
        (_, _, task) = subscriber._tasks["i0"]
        await asyncio.wait_for(asyncio.shield(task), timeout=sum(BIND_BACKOFF) + 5)
        assert inst.cache.index is None
        blocker.close()
        subscriber.sync()  # the finished subscription is dropped and made again
        await wait_until(lambda: inst.cache.index is not None, within=10, what="subscribed after all")
    finally:
        blocker.close()
        await subscriber.stop()


async def test_kv_events_without_a_tokenizer_subscribe_nothing(caplog: pytest.LogCaptureFixture) -> None:
    inst = _instance(f"tcp://127.0.0.1:{free_port()}")
    subscriber = KvEventsSubscriber([inst], precise=False)
    subscriber.sync()
    subscriber.sync()
    assert len(subscriber) == 0 and inst.cache.index is None
    assert sum("needs [prefill] tokenizer" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.timeout(20)
async def test_a_publisher_that_never_connects_is_said_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """An engine bound on another port (or one a firewall keeps out) sends nothing ever: "indexing"
    alone would hide it."""
    inst = _instance(f"tcp://*:{free_port()}")  # the engine's form: it binds, nothing listens here
    subscriber = KvEventsSubscriber([inst])
    caplog.set_level(logging.INFO, "taogate.health")
    try:
        subscriber.sync()
        await wait_until(
            lambda: any("no KV-event publisher connected" in r.getMessage() for r in caplog.records),
            within=10.0,
            what="the warning",
        )
    finally:
        await subscriber.stop()
