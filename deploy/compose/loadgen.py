"""Demo traffic for deploy/compose.yaml, so the Grafana board fills in: a mix of streaming chat and
plain completions, shared prefixes (prefix cache, affinity), now and then a long prompt (the prefill
tag) and, with --bad-every, a request for an unknown model (the error panels). Not a benchmark.

    python loadgen.py --url http://gateway:8080 --concurrency 4            # until stopped
    TAOTOKEN_API_KEY=... python loadgen.py --url http://127.0.0.1:8080 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import httpx

SYSTEMS = [f"You are assistant number {n}. Answer briefly and precisely. " * 20 for n in range(4)]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]


def body(rng: random.Random, model: str, n: int, bad: bool) -> tuple[str, dict[str, object]]:
    words = rng.choice([50, 200, 800]) if rng.random() > 0.05 else 6000  # 5 %: a long prefill
    text = f"question {n}: " + " ".join(rng.choice(WORDS) for _ in range(words))
    model = "no-such-model" if bad else model
    if rng.random() < 0.7:
        messages = [
            {"role": "system", "content": rng.choice(SYSTEMS)},
            {"role": "user", "content": text},
        ]
        return "/v1/chat/completions", {
            "model": model,
            "messages": messages,
            "max_tokens": rng.randint(8, 64),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return "/v1/completions", {"model": model, "prompt": text, "max_tokens": rng.randint(4, 32)}


async def worker(
    args: argparse.Namespace, h: httpx.AsyncClient, wid: int, stop: float, stats: dict[str, int]
) -> None:
    rng = random.Random(args.seed * 1000 + wid)
    n = 0
    while time.monotonic() < stop:
        n += 1
        bad = args.bad_every > 0 and rng.randrange(args.bad_every) == 0
        path, payload = body(rng, args.model, n, bad)
        try:
            async with h.stream("POST", args.url + path, json=payload) as r:
                async for _ in r.aiter_bytes():
                    pass
            key = f"{r.status_code // 100}xx"
        except httpx.HTTPError:
            key = "transport_error"
        stats[key] = stats.get(key, 0) + 1
        await asyncio.sleep(rng.expovariate(1.0 / args.pause) if args.pause > 0 else 0)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("TAOGATE_URL", "http://127.0.0.1:8080"))
    p.add_argument("--key-env", default="TAOTOKEN_API_KEY", help="env var holding the unified key")
    p.add_argument("--model", default="emulated-model")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.2, help="mean seconds between a worker's requests")
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until stopped)")
    p.add_argument("--bad-every", type=int, default=50, help="about 1 in N asks an unknown model (0: never)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.url = args.url.rstrip("/")
    key = os.environ.get(args.key_env, "")
    stop = time.monotonic() + (args.duration if args.duration > 0 else float("inf"))
    stats: dict[str, int] = {}
    headers = {"authorization": f"Bearer {key}", "x-request-tag": "loadgen"}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(300, connect=5)) as h:
        while True:  # wait for the gateway (compose starts everything at once)
            try:
                if (await h.get(args.url + "/ready")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
        await asyncio.gather(*(worker(args, h, w, stop, stats) for w in range(args.concurrency)))
    print("loadgen:", dict(sorted(stats.items())), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
