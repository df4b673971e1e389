"""Instructions of one dispatch, counted by callgrind over a loop of the dispatch alone.

The gateway's dispatch as ``taogate serve`` builds it (its default config, 4 instances up, models
known), driven without a network: each call is ``try_acquire`` for a tiny completion (no prefix
key, ``max_tokens`` 1, not streamed) and ``release``; ``--part request`` adds what the pipeline
does around a successful answer (the first token, the answer's load report, the breaker's success,
the learning). ``--pending K`` keeps K older requests in flight per instance without a first token,
as under 32 concurrent clients. The clock is simulated (``--step`` seconds per call) and a scrape
comes each simulated second, so runs are deterministic. The script runs itself under
``valgrind --tool=callgrind`` twice, with ``--calls`` and with none, and divides the difference.
``--src DIR`` runs another tree's ``src`` (an old checkout) in the same round: trees alternate.

    flock /tmp/taogate-heavy.lock .venv/bin/python benchmarks/dispatch_cpu.py [--calls 5000] \\
        [--part dispatch|request] [--pending 8] [--src /path/to/old/src] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "emulated"
PROMPT_TOKENS = 3
LOAD_REPORT = 'JSON {"named_metrics": {"num_requests_waiting": 0, "kv_cache_usage_perc": 0.01}}'


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Outcome:
    """What a tiny non-streamed answer tells the learning (the request's record)."""

    def __init__(self, started: float) -> None:
        self.prompt_tokens: int | None = PROMPT_TOKENS
        self.completion_tokens: int | None = 1
        self.cached_tokens: int | None = 0
        self.ttfb: float | None = 0.002
        self.started = started
        self.queue_wait = 0.0


def _loop(calls: int, part: str, pending: int, step: float) -> None:
    """The measured work: ``calls`` dispatches (and their answers, with ``part`` request)."""
    from taogate.dispatch.calibration import TokenEstimator
    from taogate.dispatch.policy import make_policy
    from taogate.dispatch.speed import SpeedEstimator
    from taogate.dispatch.tokens import PromptSize
    from taogate.dispatch.types import RequestFacts
    from taogate.fleet.dispatcher import Dispatcher
    from taogate.fleet.engine import EngineSample
    from taogate.fleet.fleet import Fleet, specs_from_settings
    from taogate.fleet.learning import Learning
    from taogate.instance_settings import InstanceSettings
    from taogate.settings import Settings

    clock = _Clock()
    settings = Settings(
        instances=[InstanceSettings(url=f"http://127.0.0.1:{9000 + i}", name=f"i{i}") for i in range(4)]
    )
    speeds = SpeedEstimator(rebuild_every=0.005, clock=clock)
    fleet = Fleet(settings, speeds)
    fleet.apply(settings, specs_from_settings(settings, {}))
    d = settings.dispatch
    policy = make_policy(d.strategy, affinity=d.prefix_affinity, affinity_slack=d.affinity_slack)
    dispatcher = Dispatcher(
        fleet, policy, queue_size=d.queue_size, queue_timeout=d.queue_timeout, clock=clock
    )
    learning = Learning(TokenEstimator(), speeds, clock)
    for inst in fleet:
        inst.health.record(True, clock.now)
        fleet.set_models(inst, {MODEL: {"id": MODEL}})
    size = PromptSize(ascii=4)

    def facts() -> RequestFacts:
        return RequestFacts(MODEL, PROMPT_TOKENS, False, max_tokens=1, tenant="bench")

    def scrape() -> None:
        for inst in fleet:
            inst.record_scrape(EngineSample(running=float(pending), waiting=0.0, kv_usage=0.01), clock.now)

    held = []
    for _ in range(pending * len(fleet)):
        got = dispatcher.try_acquire(facts())
        assert got is not None
        held.append(got[0])
    scrape()
    next_scrape = clock.now + 1.0
    for _ in range(calls):
        clock.now += step
        if clock.now >= next_scrape:
            scrape()
            next_scrape += 1.0
        f = facts()
        got = dispatcher.try_acquire(f)
        assert got is not None
        lease = got[0]
        if part == "request":
            started = clock.now
            clock.now += step
            lease.first_token()
            inst = lease.instance
            inst.record_load_report(LOAD_REPORT, clock.now)
            inst.breaker.record_success(clock.now)
            learning.learn(_Outcome(started), f, size, lease)
        lease.release()


def _count(src: str | None, calls: int, part: str, pending: int, step: float) -> int:
    """Callgrind's total instructions of this script running ``calls`` calls."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        if src is not None:
            env["PYTHONPATH"] = src
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--inner",
            str(calls),
            "--part",
            part,
            "--pending",
            str(pending),
            "--step",
            str(step),
        ]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        assert found is not None, "no total in callgrind's output"
        return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--part", choices=("dispatch", "request"), default="dispatch")
    parser.add_argument("--pending", type=int, default=0, help="older requests in flight per instance")
    parser.add_argument("--step", type=float, default=0.0002, help="simulated seconds between calls")
    parser.add_argument("--src", action="append", default=[], help="another tree's src, counted too")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner is not None:
        _loop(args.inner, args.part, args.pending, args.step)
        return 0
    trees: list[str | None] = [*args.src, None]
    for r in range(args.rounds):
        for src in trees:
            full = _count(src, args.calls, args.part, args.pending, args.step)
            empty = _count(src, 0, args.part, args.pending, args.step)
            per = (full - empty) / args.calls
            name = src or "this tree"
            print(f"round {r + 1}  {name}: {per / 1000:.1f} K instructions per call ({args.part})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
