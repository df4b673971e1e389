"""The engine's prefix cache behaves as vLLM's: hits on scheduled blocks, generated blocks cached,
vLLM's hashes, and KV events in vLLM's wire format (byte for byte against vLLM's own encoder)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from taogate.dispatch.blocks import block_hashes
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest
from taogate.emulator.kv_cache import block_removed, block_stored
from taogate.emulator.kv_events import KvEventPublisher, binds, kv_event_frames, offset_endpoint
from taogate.emulator.tokenizer import Tokenizer

CACHED = replace(EngineConfig.from_emulator(EmulatorConfig()), enable_prefix_caching=True, kv_events=True)

# vLLM 0.32's msgspec encoding of KVEventBatch(ts=1700000000.5, events=[BlockStored(block_hashes of
# [1..8], block_size 4, extra_keys=[None, None], group_idx 0, kv_cache_spec_kind "full_attention"),
# BlockRemoved(the second hash)], data_parallel_rank=0), made with vLLM's own classes.
GOLDEN = bytes.fromhex(
    "93cb41d954fc40200000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1a1eb4e3"
    "edd9361acfd41bc1f76b956ddeb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405"
    "060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65"
    "787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f"
    "617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfd41bc1f76b"
    "956ddea66d656469756da3475055a967726f75705f6964780000"
)


def run(engine: Engine) -> list[tuple[str, int]]:
    """Step until idle; the (request, cached tokens) of every first token, in order."""
    firsts: list[tuple[str, int]] = []
    while (result := engine.step()) is not None:
        firsts += [(o.request_id, o.num_cached_tokens) for o in result[1] if o.index == 0]
    return firsts


def test_a_request_admitted_later_hits_blocks_only_scheduled() -> None:
    """Two prompts sharing 1,000 tokens arrive together: the second hits the first's blocks, which
    are cached when scheduled, before they are computed (vLLM; across instances nothing is shared)."""
    engine = Engine(CACHED)
    shared = list(range(1000))
    engine.add(EngineRequest("a", [*shared, 1], 1))
    engine.add(EngineRequest("b", [*shared, 2], 1))
    assert dict(run(engine)) == {"a": 0, "b": 992}


def test_long_shared_prefix_is_prefilled_once_behind_chunks() -> None:
    engine = Engine(CACHED)  # 2,048 tokens a step: the first prompt takes two steps
    shared = list(range(4096))
    engine.add(EngineRequest("a", [*shared, 1], 1))
    engine.add(EngineRequest("b", [*shared, 2], 1))
    assert dict(run(engine)) == {"a": 0, "b": 4096}


def test_hits_after_prefill_makes_a_follower_in_flight_miss_and_a_later_one_hit() -> None:
    """The other semantics (an engine that caches a prompt only once its prefill completes): a
    follower admitted while its leader prefills computes the prefix again; one admitted after hits."""
    engine = Engine(replace(CACHED, hits_after_prefill=True, kv_events=False))
    shared = list(range(4096))
    engine.add(EngineRequest("a", [*shared, 1], 1))
    engine.add(EngineRequest("b", [*shared, 2], 1))
    assert dict(run(engine)) == {"a": 0, "b": 0}
    engine.add(EngineRequest("c", [*shared, 3], 1))
    assert dict(run(engine)) == {"c": 4096}


def test_generated_blocks_are_cached() -> None:
    engine = Engine(CACHED)
    prompt = list(range(100, 132))
    engine.add(EngineRequest("a", prompt, 40))
    run(engine)
    answer = [Tokenizer.generated_id(Tokenizer.generated_word(prompt, i)) for i in range(40)]
    engine.add(EngineRequest("b", [*prompt, *answer, 7], 1))  # the next turn repeats the answer
    assert dict(run(engine)) == {"b": 64}  # 4 full blocks: 32 prompt + 32 generated tokens


def test_events_store_at_schedule_and_remove_on_eviction() -> None:
    engine = Engine(replace(CACHED, num_kv_blocks=5, block_size=4))  # 4 usable blocks
    first = list(range(1, 10))  # 2 full blocks and a partial one
    engine.add(EngineRequest("a", first, 1))
    plan = engine.schedule()
    assert plan is not None
    assert engine.take_events() == [block_stored(block_hashes(first, 4), None, first[:8], 4)]
    engine.update(plan)
    run(engine)
    engine.take_events()
    second = list(range(50, 62))  # 3 full blocks: a's partial block, the unused one, then a cached one
    engine.add(EngineRequest("b", second, 1))
    engine.schedule()
    hashes = block_hashes(first, 4)
    stored = block_stored(block_hashes(second, 4), None, second, 4)
    assert engine.take_events() == [block_removed(hashes[1]), stored]  # a's prefix outlives its tail


def test_chunked_prefill_chains_its_events() -> None:
    engine = Engine(replace(CACHED, max_num_batched_tokens=32))
    prompt = list(range(70))
    engine.add(EngineRequest("a", prompt, 1))
    events: list[dict[str, Any]] = []
    while (result := engine.step()) is not None:
        events += engine.take_events()
        del result
    hashes = block_hashes(prompt, 16)
    assert [e["block_hashes"] for e in events] == [hashes[:2], hashes[2:4]]
    assert [e["parent_block_hash"] for e in events] == [None, hashes[1]]


def test_frames_match_vllms_bytes() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = block_hashes(tokens, 4)
    events = [block_stored(hashes, None, tokens, 4), block_removed(hashes[1])]
    topic, seq, payload = kv_event_frames("kv", 48, 1700000000.5, events)
    assert (topic, seq) == (b"kv", (48).to_bytes(8, "big"))
    assert payload == GOLDEN


def test_bind_or_connect_and_port_offsets() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::1]:5557") and binds("ipc:///tmp/x")
    assert not binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/x", 1) == "ipc:///tmp/x"


@pytest.mark.timeout(20)
async def test_publisher_sends_and_replays() -> None:
    pytest.importorskip("zmq")
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    replay_port = _free_port()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", replay=f"tcp://127.0.0.1:{replay_port}")
    pub.start()
    try:
        event = block_removed(5)
        got: list[bytes] = []
        for _ in range(200):  # the slow joiner: publish until the subscription is through
            pub.publish([event])
            if await sub.poll(20):
                got = await sub.recv_multipart()
                break
        msgpack = pytest.importorskip("msgpack")
        assert got[0] == b"kv" and msgpack.unpackb(got[2])[1:] == [[event], 0]
        seq = int.from_bytes(got[1], "big")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", seq.to_bytes(8, "big")])
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 5)]
        while replies[-1][2] != (-1).to_bytes(8, "big", signed=True):
            replies.append(await asyncio.wait_for(dealer.recv_multipart(), 5))
        assert int.from_bytes(replies[0][2], "big") == seq and replies[0][1] == b"kv"
        assert len(replies) == pub.next_seq - seq + 1
        dealer.close()
    finally:
        await pub.aclose()
        sub.close()
        ctx.term()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
