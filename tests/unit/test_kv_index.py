"""The KV-event index: reference counts, the longest cached run, gaps, restarts, the bound."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import block_removed, block_stored
from taogate.fleet.kv_index import KvIndex

TOKENS = list(range(64))
HASHES = block_hashes(TOKENS, 16)


def stored(
    hashes: list[int], parent: int | None = None, tokens: list[int] | None = None
) -> dict[str, object]:
    return block_stored(hashes, parent, tokens if tokens is not None else TOKENS[: 16 * len(hashes)], 16)


def test_longest_run_and_duplicates() -> None:
    index = KvIndex(100, 16)
    assert index.apply(0, [stored(HASHES[:3])]) == "ok"
    assert index.matches is True  # our hash of the root block is the engine's
    assert index.cached_run(HASHES) == 3
    index.apply(1, [stored(HASHES[1:2], HASHES[0], TOKENS[16:32])])  # a duplicate of block 1
    index.apply(2, [block_removed(HASHES[1])])
    assert index.cached_run(HASHES) == 3  # the other copy still serves hits
    index.apply(3, [block_removed(HASHES[1])])
    assert index.cached_run(HASHES) == 1  # a run stops at its first miss


def test_trust_gaps_and_restarts() -> None:
    index = KvIndex(4, 16)
    index.configure(4, 16)  # the engine's own size: what a proof by evictions needs
    index.apply(7, [stored(HASHES[:2])])  # joined late: what came before is unknown
    assert not index.trusted
    index.apply(8, [stored(HASHES[2:4], HASHES[1], TOKENS[32:64])])
    assert not index.trusted  # stored as many as it holds, but blocks held before may live on
    index.apply(9, [block_removed(h) for h in (11, 12, 13, 14)])  # 4 blocks never seen stored
    assert index.trusted  # as many unseen blocks evicted as the engine holds: complete
    assert index.apply(11, [stored(HASHES[:1])]) == "gap"
    assert not index.trusted and index.next_seq == 10
    index.apply(10, [])
    index.apply(11, [])
    index.replayed()
    assert index.trusted
    assert index.apply(0, [stored(HASHES[:1])]) == "restart"  # the engine started again: empty
    assert index.trusted and index.cached_run(HASHES) == 1


def test_start_over_after_an_unfillable_gap() -> None:
    index = KvIndex(4, 16)
    index.apply(0, [stored(HASHES[:4])])
    index.apply(5, [])
    index.start_over()
    assert len(index) == 0 and index.next_seq is None and not index.trusted


def test_another_hash_function_turns_precise_mode_off() -> None:
    index = KvIndex(10, 16)
    index.apply(0, [stored([12345], tokens=TOKENS[:16])])
    assert index.matches is False and not index.usable and index.off is not None


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=200), cap=st.integers(1, 30))
def test_property_never_more_than_the_instance_holds(ops: list[tuple[bool, int]], cap: int) -> None:
    index = KvIndex(cap, 16)
    for seq, (store, h) in enumerate(ops):
        index.apply(seq, [stored([h], 1, TOKENS[:16])] if store else [block_removed(h)])
        assert len(index) <= cap


def test_batches_a_replay_already_applied_are_stale_not_a_restart() -> None:
    index = KvIndex(100, 16)
    index.apply(0, [stored(HASHES[:1])], ts=1.0)
    for seq in (1, 2, 3):  # what a replay applied after a gap
        block = stored(HASHES[seq : seq + 1], HASHES[seq - 1], TOKENS[16 * seq : 16 * seq + 16])
        index.apply(seq, [block], 1.0 + seq)
    # the same batches, queued on the live socket meanwhile, arrive now
    assert index.apply(2, [stored(HASHES[2:3], HASHES[1], TOKENS[32:48])], ts=3.0) == "stale"
    assert index.apply(3, [], ts=4.0) == "stale"
    assert index.trusted and index.cached_run(HASHES) == 4 and index.restarts == 0


def test_a_restart_first_seen_past_zero_missed_batches() -> None:
    index = KvIndex(100, 16)
    index.apply(0, [stored(HASHES[:2])], ts=10.0)
    index.apply(1, [], ts=11.0)
    index.apply(2, [], ts=12.0)
    # a fresh engine whose batches 0 and 1 were lost: below the next expected, stamped later
    assert index.apply(2, [stored(HASHES[:1])], ts=20.0) == "restart"
    assert not index.trusted and index.restarts == 1 and index.next_seq == 3 and len(index) == 1
    assert index.apply(0, [], ts=30.0) == "restart"  # seen from its very first batch: complete
    assert index.trusted


def test_offloaded_copies_and_other_groups_stay_out() -> None:
    index = KvIndex(100, 16)
    cpu = {**stored(HASHES[:1]), "medium": "CPU"}
    other_group = {**stored(HASHES[:1]), "group_idx": 1}
    index.apply(0, [cpu, other_group])
    assert len(index) == 0
    index.apply(1, [stored(HASHES[:2])])
    cpu_removed = {**block_removed(HASHES[0]), "medium": "CPU"}
    index.apply(2, [cpu_removed, {**block_removed(HASHES[1]), "group_idx": 1}])
    assert index.cached_run(HASHES) == 2  # the GPU copies are still there


def test_another_hash_algorithm_turns_precise_mode_off() -> None:
    index = KvIndex(10, 16)
    assert index.usable
    index.configure(10, 16, "xxhash")
    assert not index.usable and index.off is not None and "xxhash" in index.off
    index.configure(10, 16, "sha256")
    assert index.usable
