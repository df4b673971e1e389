"""Block pool as vLLM keeps it: null block, duplicates, free-queue order, usage, eviction events."""

from __future__ import annotations

import pytest

from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import BlockPool


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([99, *range(1, 40)], 16)
    assert len(a) == 2  # the trailing partial block is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix → different hash
    assert block_hashes(list(range(40)), 16) == a


def test_hashes_are_vllms() -> None:
    """The test vector computed with vLLM's own hash_block_tokens (sha256, default seed)."""
    tokens = [*range(1000, 1128), *range(5000, 5128)]
    assert block_hashes(tokens, 128) == [7878042686567188777, 1224442355005345535]


def test_null_block_is_never_handed_out_and_usage_excludes_it() -> None:
    pool = BlockPool(5, caching=True)
    assert pool.capacity == 4 and pool.num_free == 4
    blocks = pool.allocate(4)
    assert 0 not in blocks and pool.usage == 1.0
    pool.free(blocks[:2])
    assert pool.usage == 0.5


def test_free_blocks_stay_cached_until_reused_lru_first() -> None:
    pool = BlockPool(5, caching=True)
    first = pool.allocate(2)
    pool.register(first[0], 111)
    pool.register(first[1], 222)
    pool.free(first)  # tail first: the block for 222 goes to the queue before 111's
    assert pool.num_free == 4 and pool.lookup([111, 222], 2) == first
    pool.allocate(3)  # two never-used blocks, then the least recently freed (222's)
    assert pool.lookup([111], 1) == [first[0]]
    assert pool.lookup([111, 222], 2) == [first[0]]


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, caching=True)
    cached, partial = pool.allocate(2)
    pool.register(cached, 7)
    pool.free([cached, partial])
    assert pool.allocate(1) == [partial]  # pushed to the head when freed, before never-used blocks
    pool.allocate(1)  # the never-used one; the cached block, at the tail, is still there
    assert pool.lookup([7], 1) == [cached]


def test_duplicates_are_kept_and_survive_one_eviction() -> None:
    pool = BlockPool(4, caching=True, events=True)
    a, b = pool.allocate(2)
    pool.register(a, 9)
    pool.register(b, 9)  # two requests computed the same block
    pool.free([a])
    pool.free([b])
    pool.allocate(2)  # the never-used block, then a
    assert pool.lookup([9], 1) == [b]
    assert pool.take_events() == [
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "group_idx": 0}
    ]


def test_touch_shares_and_protects_blocks() -> None:
    pool = BlockPool(3, caching=True)
    (block,) = pool.allocate(1)
    pool.register(block, 7)
    pool.free([block])
    pool.touch([block])
    pool.touch([block])  # two requests share it
    assert pool.num_used == 1
    pool.free([block])
    assert pool.num_used == 1  # still referenced once
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)


def test_caching_off_never_finds_anything_and_says_nothing() -> None:
    pool = BlockPool(3, caching=False, events=True)
    (block,) = pool.allocate(1)
    pool.register(block, 5)
    assert pool.lookup([5], 1) == []
    assert pool.take_events() == []
