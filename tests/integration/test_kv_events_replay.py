"""Lost KV events: the subscriber asks the engine's replay socket for the missing batches and the
index is whole again; without a replay socket it starts over (and dispatch falls back meanwhile)."""

from __future__ import annotations

import logging
import math
import socket

import pytest

from taogate.bench.procs import free_port
from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import block_stored
from taogate.emulator.kv_events import KvEventPublisher, kv_event_frames
from taogate.fleet.instance import Instance, InstanceSpec
from tests.conftest import wait_until

pytest.importorskip("zmq")
from taogate.control.kv_events import KvEventsSubscriber

TOKENS = list(range(64))
HASHES = block_hashes(TOKENS, 16)


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _instance(replay: str | None, kv_events: str | None = None) -> Instance:
    kv_events = kv_events or _endpoint()
    spec = InstanceSpec("i0", "http://127.0.0.1:1", kv_events=kv_events, kv_events_replay=replay)
    return Instance(spec, unhealthy_after=2, healthy_after=1, breaker_failures=5, breaker_cooldown=1.0)


def _batches() -> list[list[dict[str, object]]]:
    return [
        [block_stored(HASHES[i : i + 1], HASHES[i - 1] if i else None, TOKENS[16 * i : 16 * i + 16], 16)]
        for i in range(4)
    ]


@pytest.mark.timeout(20)
async def test_a_gap_is_replayed() -> None:
    replay = _endpoint()
    inst = _instance(replay)
    publisher = KvEventPublisher("tcp://127.0.0.1:1", replay=replay)  # its PUB goes nowhere here
    publisher.start()
    subscriber = KvEventsSubscriber([inst])
    try:
        batches = _batches()
        for events in batches:
            publisher.publish(events)
        index = inst.cache.enable_index()
        payload = [kv_event_frames("", seq, 0.0, b)[2] for seq, b in enumerate(batches)]
        await subscriber._batch(inst, index, 0, payload[0])
        await subscriber._batch(inst, index, 3, payload[3])  # 1 and 2 were lost
        assert index.cached_run(HASHES) == 4 and index.trusted and index.next_seq == 4
    finally:
        await publisher.aclose()


async def test_without_replay_the_index_starts_over() -> None:
    inst = _instance(None)
    subscriber = KvEventsSubscriber([inst])
    index = inst.cache.enable_index()
    batches = _batches()
    payload = [kv_event_frames("", seq, 0.0, b)[2] for seq, b in enumerate(batches)]
    await subscriber._batch(inst, index, 0, payload[0])
    await subscriber._batch(inst, index, 3, payload[3])
    assert index.cached_run(HASHES) == 0 and len(index) == 1 and not index.trusted
    assert index.state()[0] == "model"  # dispatch falls back to the model meanwhile


@pytest.mark.timeout(20)
@pytest.mark.parametrize("buffer_steps", [10, 2])
async def test_at_start_everything_from_seq_0_is_asked_for(buffer_steps: int) -> None:
    replay = _endpoint()
    inst = _instance(replay)
    publisher = KvEventPublisher("tcp://127.0.0.1:1", replay=replay, buffer_steps=buffer_steps)
    publisher.start()
    subscriber = KvEventsSubscriber([inst])
    try:
        for events in _batches():
            publisher.publish(events)
        index = inst.cache.enable_index()
        assert await subscriber.replays.catch_up(inst, index)
        if buffer_steps == 10:  # it still has batch 0: whole
            assert index.trusted and index.trust.reason == "replayed" and index.next_seq == 4
            assert index.cached_run(HASHES) == 4
        else:  # its buffer has lost batches 0 and 1: what they stored is unknown
            assert not index.trusted and index.trust.reason == "missed_start"
            assert "replay buffer begins at seq 2" in index.trust.detail
    finally:
        await publisher.aclose()


@pytest.mark.timeout(20)
async def test_a_restart_whose_first_batches_were_missed_is_replayed_whole() -> None:
    replay = _endpoint()
    inst = _instance(replay)
    subscriber = KvEventsSubscriber([inst])
    index = inst.cache.enable_index()
    index.apply(0, [], ts=1.0)
    for seq in range(1, 10):
        index.apply(seq, [], ts=1.0 + seq)
    publisher = KvEventPublisher("tcp://127.0.0.1:1", replay=replay)  # the engine, started again
    publisher.start()
    try:
        batches = _batches()
        for events in batches:
            publisher.publish(events, ts=100.0)
        payload = kv_event_frames("", 3, 100.0, batches[3])[2]
        await subscriber._batch(inst, index, 3, payload)  # below 10, stamped later: a restart
        assert index.restarts == 1 and index.trusted and index.trust.reason == "replayed"
        assert index.cached_run(HASHES) == 4 and index.next_seq == 4
    finally:
        await publisher.aclose()


@pytest.mark.timeout(30)
async def test_a_replay_socket_silent_at_first_is_asked_again_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine started first whose replay socket does not answer the subscription's first ask
    (a busy engine answers late): the index runs on what it sees, degraded, and the socket is asked
    again until the replay makes it whole."""
    caplog.set_level(logging.INFO, "taogate.health")
    port, replay = free_port(), _endpoint()
    publisher = KvEventPublisher(f"tcp://*:{port}", replay=replay)  # its replay socket not yet served
    inst = _instance(replay, kv_events=f"tcp://*:{port}")
    subscriber = KvEventsSubscriber([inst])
    batches = _batches()
    try:
        publisher.publish(batches[0])  # before the gateway subscribed
        subscriber.sync()
        await wait_until(
            lambda: bool(_said(caplog, "did not answer within")), within=10, what="a silent replay"
        )
        for events in batches[1:]:
            publisher.publish(events)
        index = inst.cache.index
        assert index is not None
        await wait_until(lambda: index.next_seq == 4, what="the live batches")
        before = index.trust
        assert not before.trusted and before.reason == "missed_start"
        publisher.start()  # it answers from now on
        await wait_until(lambda: index.trusted, within=10, what="asked again and whole")
        after = index.trust
        assert after.reason == "replayed" and index.cached_run(HASHES) == 4 and index.next_seq == 4
        # Said once, whatever the asks it took (on a slow machine the next may come before the start).
        assert _said(caplog, "its replay socket answered on ask ")
        assert len(_said(caplog, "did not answer within")) == 1
    finally:
        await subscriber.stop()
        await publisher.aclose()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_a_gap_whose_replay_keeps_silent_starts_over_and_is_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "taogate.health")
    inst = _instance(_endpoint())  # nothing answers there
    subscriber = KvEventsSubscriber([inst])
    ask = subscriber.replays.begin(inst.name)  # as a running subscription does
    index = inst.cache.enable_index()
    payload = [kv_event_frames("", seq, 0.0, b)[2] for seq, b in enumerate(_batches())]
    await subscriber._batch(inst, index, 0, payload[0])
    await subscriber._batch(inst, index, 3, payload[3])
    assert not index.trusted and index.trust.reason == "gap"
    assert (
        "batches 1..2 lost (the engine's replay did not answer; it is asked again later)"
        in index.trust.detail
    )
    assert ask.silences == 1 and ask.at < math.inf  # the subscription asks for every batch later
    assert len(_said(caplog, "did not answer within 2 s")) == 1
