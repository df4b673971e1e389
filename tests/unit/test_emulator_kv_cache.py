"""Block pool and hash chain: sharing, LRU order, eviction of cached blocks only when free."""

from __future__ import annotations

import pytest

from taogate.emulator.kv_cache import BlockPool, block_hashes


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([99, *range(1, 40)], 16)
    assert len(a) == 2  # the trailing partial block is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix → different hash
    assert block_hashes(list(range(40)), 16) == a


def test_free_blocks_stay_cached_until_reused_lru_first() -> None:
    pool = BlockPool(4, caching=True)
    first = pool.allocate(2)
    pool.register(first[0], 111)
    pool.register(first[1], 222)
    pool.free(first)  # tail first: block for 222 becomes older than 111's in the queue
    assert pool.num_free == 4 and pool.lookup([111, 222], 2) == first
    pool.allocate(3)  # two never-used blocks, then the least recently freed (222's)
    assert pool.lookup([111], 1) == [first[0]]
    assert pool.lookup([111, 222], 2) == [first[0]]


def test_touch_shares_and_protects_blocks() -> None:
    pool = BlockPool(2, caching=True)
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


def test_caching_off_never_finds_anything() -> None:
    pool = BlockPool(2, caching=False)
    (block,) = pool.allocate(1)
    pool.register(block, 5)
    assert pool.lookup([5], 1) == []
