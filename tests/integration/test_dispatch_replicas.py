"""Two gateway replicas (each its own app and uvicorn server) in front of the same instances.

Each replica knows only its own in-flight work; the engines' scraped waiting/running covers the rest.
"""

from __future__ import annotations

import asyncio
import statistics

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet

from .dispatch_helpers import (
    admin_rows,
    client,
    complete,
    serve_gateway,
    served_counts,
    settings_for,
    wait_until,
    words,
)


async def test_two_replicas_split_a_load_and_stay_balanced() -> None:
    configs = [EmulatorConfig(seed=i) for i in range(4)]
    async with run_fleet(configs) as fleet:
        settings = settings_for(fleet.urls, dispatch={"prefix_affinity": False})
        async with serve_gateway(settings) as a, serve_gateway(settings) as b, client() as http:
            slots = asyncio.Semaphore(8)

            async def one(k: int) -> str:
                async with slots:
                    gate = a if k % 2 else b
                    r = await complete(http, gate, words(1_000, seed=k), max_tokens=2)
                    assert r.status_code == 200
                    return r.headers["x-taogate-instance"]

            await asyncio.gather(*(one(k) for k in range(48)))
            for gate in (a, b):
                assert all(i.inflight == 0 and i.prefill_tokens == 0 for i in gate.gateway.fleet)
        counts = served_counts(fleet, min_prompt=500)
    assert sum(counts) == 48
    assert max(counts) / statistics.mean(counts) < 1.5, counts
    assert min(counts) / statistics.mean(counts) > 0.5, counts


async def test_a_replica_steers_around_load_only_the_other_replica_sent() -> None:
    """Replica A fronts i0 alone and queues work there; replica B (i0 and i1) has nothing of its own
    in flight anywhere, yet sends its requests to i1, because i0's scraped queue says it is busy."""
    configs = [EmulatorConfig(seed=0, max_num_seqs=1, step_overhead=0.02), EmulatorConfig(seed=1)]
    async with run_fleet(configs) as fleet:
        only_i0 = settings_for(fleet.urls[:1], dispatch={"scrape_interval": 0.1})
        both = settings_for(fleet.urls, dispatch={"scrape_interval": 0.1, "prefix_affinity": False})
        async with serve_gateway(only_i0) as a, serve_gateway(both) as b, client() as http:
            # Four ~0.3 s requests through A: one runs on i0, three wait in its engine.
            load = [asyncio.create_task(complete(http, a, f"busy {k}", max_tokens=15)) for k in range(4)]
            i0 = b.gateway.fleet.get("i0")
            # B's next scrape sees i0's engine queue (bounded polling, at most 2 s).
            await wait_until(lambda: i0.engine is not None and (i0.engine.waiting or 0) >= 2, within=2.0)
            rows = await admin_rows(http, b)
            assert rows["i0"]["engine_waiting"] >= 1 and rows["i0"]["inflight"] == 0  # none of it B's

            served = [await complete(http, b, words(200, seed=k)) for k in range(4)]
            assert [r.headers["x-taogate-instance"] for r in served] == ["i1"] * 4
            assert [r.status_code for r in await asyncio.gather(*load)] == [200] * 4
