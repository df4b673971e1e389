"""When may a KV-event index that joined late be trusted? Two rules against the engine's truth.

An engine's block pool (the emulator's, vLLM's rules: LRU free queue, hits keep blocks alive)
serves random requests over a few shared documents; the index joins at a random batch, without
replay. After each later batch, each rule says "trusted" or not, and the index is compared with
the blocks the engine really holds:

- turnover: trusted once it has seen as many blocks stored as the engine holds (the old rule);
- proof: ``KvIndex``'s own, trusted once every block the engine may hold unseen is evicted since
  (bounded by its size and by its token counters).

Prints, per rule, the batches it trusted and how many of those the index was wrong at.

    .venv/bin/python benchmarks/kv_trust_rules.py [--workloads 2000] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import random

from taogate.dispatch.blocks import block_hashes
from taogate.emulator.kv_cache import BlockPool, block_stored
from taogate.fleet.kv_index import KvIndex

BS = 16
DOCS = [list(range(d * 1000, d * 1000 + 8 * BS)) for d in range(6)]
CHAINS = [block_hashes(doc, BS) for doc in DOCS]


def run(rng: random.Random, counts: dict[str, list[int]]) -> None:
    capacity = rng.randint(8, 24)
    pool = BlockPool(capacity + 1, caching=True, events=True)
    join = rng.randint(0, 30)
    index = KvIndex(capacity, BS)
    index.configure(capacity, BS)
    stored_since_join = tokens = 0
    for seq in range(rng.randint(1, 60)):
        doc, n = rng.randint(0, 5), rng.randint(1, 8)
        hashes = CHAINS[doc][:n]
        hit = pool.lookup(hashes, n)
        pool.touch(hit)
        fresh = pool.allocate(n - len(hit))
        for block, h in zip(fresh, hashes[len(hit) :], strict=True):
            pool.register(block, h)
        events = pool.take_events()
        if fresh:
            first = len(hit)
            parent = CHAINS[doc][first - 1] if first else None
            events.append(block_stored(hashes[first:], parent, DOCS[doc][first * BS : n * BS], BS))
        pool.free(hit + fresh)
        tokens += n * BS
        if seq < join:
            continue
        index.apply(seq, events)
        if seq == join:
            index.bound_unknown(math.ceil(tokens / BS))  # a scrape of its counters
        stored_since_join += len(fresh)
        right = set(index._refs) == set(pool._hash_of.values())
        for rule, trusted in (("turnover", stored_since_join >= capacity), ("proof", index.trusted)):
            if trusted:
                counts[rule][0] += 1
                counts[rule][1] += not right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = {"turnover": [0, 0], "proof": [0, 0]}
    for _ in range(args.workloads):
        run(rng, counts)
    for rule, (trusted, wrong) in counts.items():
        share = wrong / trusted if trusted else 0.0
        print(f"{rule:9s} trusted at {trusted:6d} batches, wrong at {wrong:6d} of them ({share:.1%})")


if __name__ == "__main__":
    main()
