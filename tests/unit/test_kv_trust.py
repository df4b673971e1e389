"""When the KV-event index is trusted, and why: the proofs of completeness, and the lines said.

The property test runs an engine's block pool (the emulator's, vLLM's rules) with a subscriber that
joins late: whenever the index says it is trusted by a proof, it holds exactly the engine's blocks.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.control.kv_events import blocks_ever
from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import BlockPool, block_removed, block_stored
from taogate.fleet.engine import EngineSample
from taogate.fleet.kv_index import KvIndex
from taogate.fleet.kv_trust import REASONS, TRUSTED, Trust, trust_message

BS = 16
DOCS = [list(range(d * 1000, d * 1000 + 8 * BS)) for d in range(6)]  # 6 documents of 8 blocks
CHAINS = [block_hashes(doc, BS) for doc in DOCS]


def stored(doc: int, first: int, last: int) -> dict[str, object]:
    parent = CHAINS[doc][first - 1] if first else None
    return block_stored(CHAINS[doc][first:last], parent, DOCS[doc][first * BS : last * BS], BS)


def test_the_first_batch_says_whether_the_start_was_seen() -> None:
    index = KvIndex(100, BS)
    assert index.trust.reason == "waiting" and not index.trusted
    index.apply(0, [stored(0, 0, 2)])
    assert index.trusted and index.trust.reason == "from_start" and index.state() == ("index", "from_start")
    late = KvIndex(100, BS)
    late.apply(5, [stored(0, 0, 2)])
    assert not late.trusted and late.trust.reason == "missed_start" and "seq 5" in late.trust.detail
    assert late.state() == ("model", "missed_start")


def test_an_idle_engine_is_complete_and_its_first_batch_must_be_zero() -> None:
    index = KvIndex(100, BS)
    index.bound_unknown(0)  # its counters: nothing processed, nothing in use
    assert index.trusted and index.trust.reason == "quiet" and index.next_seq == 0
    assert index.apply(3, [stored(0, 0, 1)]) == "gap"  # batches 0..2 went missing
    assert not index.trusted and index.trust.reason == "gap" and index.trust.detail == "batches 0..2 lost"


def test_a_missed_start_is_trusted_once_the_blocks_held_before_are_evicted() -> None:
    index = KvIndex(100, BS)
    index.apply(4, [stored(1, 0, 2)])
    assert index.unknown is None  # neither its size nor its counters known: nothing to prove with
    index.bound_unknown(3)  # the engine processed at most 3 blocks' worth before
    assert not index.trusted and index.unknown == 3
    index.apply(5, [block_removed(CHAINS[1][1])])  # one we saw stored: not an old one
    index.apply(6, [block_removed(CHAINS[2][0]), block_removed(CHAINS[2][1])])  # two unseen
    assert not index.trusted and index.unknown == 1
    index.apply(7, [block_removed(CHAINS[3][0])])
    assert index.trusted and index.trust.reason == "old_blocks_gone"


def test_a_default_size_proves_nothing() -> None:
    index = KvIndex(2, BS)  # the model's default, before the engine's scrape says its size
    index.apply(4, [block_removed(CHAINS[2][0]), block_removed(CHAINS[2][1])])
    assert not index.trusted and index.unknown is None
    index.configure(3, BS)  # its own size: one more unseen block may be there
    assert not index.trusted and index.unknown == 1
    index.apply(5, [block_removed(CHAINS[2][2])])
    assert index.trusted and index.trust.reason == "old_blocks_gone"


def test_a_cleared_cache_and_a_restart_make_it_complete() -> None:
    index = KvIndex(100, BS)
    index.apply(9, [stored(0, 0, 1)])
    index.apply(10, [{"type": "AllBlocksCleared"}])
    assert index.trusted and index.trust.reason == "cleared" and len(index) == 0
    late = KvIndex(100, BS)
    late.apply(9, [stored(0, 0, 1)])
    assert late.apply(0, [stored(1, 0, 1)]) == "restart"
    assert late.trusted and late.trust.reason == "restart" and late.restarts == 1


def test_a_replay_gives_back_the_trust_the_gap_took() -> None:
    index = KvIndex(100, BS)
    index.apply(0, [stored(0, 0, 1)])
    assert index.apply(3, []) == "gap" and index.trust.reason == "gap" and index.gaps == 1
    index.apply(1, [])
    index.apply(2, [])
    index.replayed()
    assert index.trusted and index.trust.reason == "replayed"
    untrusted = KvIndex(100, BS)
    untrusted.apply(7, [])
    untrusted.apply(9, [])
    untrusted.apply(8, [])
    untrusted.replayed()
    assert not untrusted.trusted and untrusted.trust.reason == "missed_start"


def test_a_gap_without_replay_starts_over_and_says_so() -> None:
    index = KvIndex(100, BS)
    index.apply(0, [stored(0, 0, 2)])
    index.start_over("gap", "batches 1..4 lost")
    index.apply(5, [stored(1, 0, 1)])  # the batch after the gap is the first one again
    assert not index.trusted and index.trust == Trust("gap", "batches 1..4 lost") and len(index) == 1


def test_recovered_by_a_replay_from_the_start() -> None:
    index = KvIndex(100, BS)
    index.recovered("its replay socket holds no batch")
    assert index.trusted and index.next_seq == 0 and not index.tracking


def test_another_hash_turns_it_off_whatever_the_trust() -> None:
    index = KvIndex(100, BS)
    index.apply(0, [stored(0, 0, 1)])
    index.configure(100, BS, "sha256_cbor")
    assert index.state() == ("model", "off")


def test_the_bound_from_the_engine_counters() -> None:
    idle = EngineSample(prompt_tokens=0.0, generation_tokens=0.0, kv_usage=0.0, engines=1)
    assert blocks_ever(idle, BS, 1000) == 0
    busy = EngineSample(prompt_tokens=100.0, generation_tokens=20.0, kv_usage=0.01, engines=2)
    assert blocks_ever(busy, BS, 1000) == math.ceil(120 / BS) + 20
    assert blocks_ever(EngineSample(prompt_tokens=1.0, generation_tokens=1.0), BS, 1000) is None


def test_every_reason_has_its_line() -> None:
    for reason in REASONS:
        line = trust_message("a", Trust(reason, "why"), replay=False)
        assert line.startswith("instance a: precise mode ") and "why" in line
        assert ("uses the KV-event index" in line) == (reason in TRUSTED)
    assert "kv_events_replay" in trust_message("a", Trust("gap", "x"), replay=True)


# -- the property: a proven index is the engine's cache -----------------------------------------
Batch = tuple[list[object], set[int], int]


def _engine_batches(requests: list[tuple[int, int]], capacity: int) -> list[Batch]:
    """One batch per request: (its events, the hashes the engine holds after it, tokens so far)."""
    pool = BlockPool(capacity + 1, caching=True, events=True)
    out: list[Batch] = []
    tokens = 0
    for doc, n in requests:
        hashes = CHAINS[doc][:n]
        hit = pool.lookup(hashes, n)
        pool.touch(hit)
        fresh = pool.allocate(n - len(hit))
        for block, h in zip(fresh, hashes[len(hit) :], strict=True):
            pool.register(block, h)
        events: list[object] = [*pool.take_events()]
        if fresh:
            events.append(stored(doc, len(hit), n))
        pool.free(hit + fresh)
        tokens += n * BS
        out.append((events, set(pool._hash_of.values()), tokens))
    return out


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=1, max_size=60),
    join=st.integers(0, 30),
    capacity=st.integers(8, 24),
    bound=st.booleans(),
    sized=st.booleans(),
)
def test_property_a_proven_index_holds_exactly_the_engines_blocks(
    requests: list[tuple[int, int]], join: int, capacity: int, bound: bool, sized: bool
) -> None:
    index = KvIndex(capacity if sized else 10_000, BS)  # unsized: a default, the engine's unknown
    if sized:
        index.configure(capacity, BS)
    for seq, (events, held, tokens) in enumerate(_engine_batches(requests, capacity)):
        if seq < join:
            continue
        index.apply(seq, events)
        if bound and seq == join:  # a scrape after the subscription: the counters so far
            index.bound_unknown(math.ceil(tokens / BS))
        if index.trusted:
            assert set(index._refs) == held, index.trust
