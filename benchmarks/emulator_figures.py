"""Real-time latency figures of the emulator's engine model: one long prompt, then 16 at once, direct.

Starts two emulated instances in-process, a normal one and a 2.5x slow one (prefix caching off), and
times non-stream ``/v1/completions`` over httpx: one ~4,096-token request, then 16 concurrent ones
with unique prompts, ``max_tokens`` 16. Run: ``.venv/bin/python benchmarks/emulator_figures.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from taogate.emulator import EmulatorConfig, run_fleet
from taogate.emulator.tokenizer import Tokenizer

SENTENCE = "The quick brown fox jumps over the lazy dog . "  # 10 tokens under the emulator's rule
CONCURRENCY = 16


def prompt(i: int) -> str:
    # Unique from the first token, so no two prompts could ever share a cached prefix.
    return f"request number {i} . " + SENTENCE * 409


async def one(http: httpx.AsyncClient, url: str, i: int) -> float:
    start = time.perf_counter()
    r = await http.post(
        url + "/v1/completions",
        json={"model": "emulated-model", "prompt": prompt(i), "max_tokens": 16, "temperature": 0},
        headers={"X-Request-Tag": "prefill-bench"},
    )
    r.raise_for_status()
    return time.perf_counter() - start


async def main() -> None:
    tokens = len(Tokenizer().encode(prompt(0)))
    configs = [EmulatorConfig(), EmulatorConfig(slowdown=2.5)]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with run_fleet(configs) as fleet, httpx.AsyncClient(timeout=120, limits=limits) as http:
        print(f"prompt tokens per request: {tokens}, max_tokens 16, prefix caching off")
        for name, url in zip(("normal", "slow x2.5"), fleet.urls, strict=True):
            await one(http, url, -1)  # warm the connection
            single = await one(http, url, 0)
            batch = await asyncio.gather(*(one(http, url, 1000 + i) for i in range(CONCURRENCY)))
            mean = statistics.mean(batch)
            print(
                f"{name:10s} single {single:6.3f} s | {CONCURRENCY} concurrent: mean {mean:6.3f} s"
                f"  min {min(batch):6.3f} s  max {max(batch):6.3f} s"
                f"  (~{CONCURRENCY * tokens / max(batch):,.0f} prompt tokens/s)"
            )


if __name__ == "__main__":
    asyncio.run(main())
