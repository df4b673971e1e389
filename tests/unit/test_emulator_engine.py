"""The engine model in virtual time: scheduling, costs, KV, prefix cache. Nothing here sleeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest, SeqOutput


@dataclass
class Timeline:
    arrival: float
    # NaN until set: any comparison with an unset time fails the test.
    first: float = math.nan
    finish: float = math.nan
    reason: str | None = None
    cached: int = 0
    tokens: int = 0


def simulate(
    engine: Engine, arrivals: list[tuple[float, EngineRequest]], max_steps: int = 100_000
) -> dict[str, Timeline]:
    """Run the engine in virtual time; requests arriving mid-step join at the next step boundary."""
    pending = sorted(arrivals, key=lambda a: a[0])
    out: dict[str, Timeline] = {}
    now = 0.0
    for _ in range(max_steps):
        while pending and pending[0][0] <= now:
            at, req = pending.pop(0)
            engine.add(req)
            out[req.request_id] = Timeline(at)
        result = engine.step()
        if result is None:
            if not pending:
                return out
            now = pending[0][0]
            continue
        plan, outputs = result
        now += plan.duration
        for o in outputs:
            _record(out[o.request_id], o, now)
    raise AssertionError("simulation did not finish")


def _record(t: Timeline, o: SeqOutput, now: float) -> None:
    if o.index is not None:
        t.tokens += 1
        if o.index == 0:
            t.first = now
            t.cached = o.num_cached_tokens
    if o.finish_reason is not None:
        t.finish, t.reason = now, o.finish_reason


def req(rid: str, n: int, max_tokens: int = 16, base: int = 0) -> EngineRequest:
    """A prompt of ``n`` token ids; different ``base`` values give prompts with no common prefix."""
    return EngineRequest(rid, [base * 100_000 + i for i in range(n)], max_tokens)


DEFAULT = EngineConfig.from_emulator(EmulatorConfig())


def test_defaults_give_article_shapes() -> None:
    t = simulate(Engine(DEFAULT), [(0.0, req("a", 4096))])["a"]
    assert 0.1 <= t.first <= 0.3  # ~0.23 s: two 2048-token chunks
    per_token = (t.finish - t.first) / 15
    assert 0.010 <= per_token <= 0.030
    assert t.reason == "length" and t.tokens == 16


def test_prefill_cost_is_proportional_to_uncached_tokens() -> None:
    cfg = replace(DEFAULT, step_overhead=0.0, max_num_batched_tokens=100_000)
    ttft = {n: simulate(Engine(cfg), [(0.0, req("a", n, 1))])["a"].first for n in (1000, 4000)}
    assert ttft[1000] == pytest.approx(1000 / cfg.prefill_tokens_per_s)
    assert ttft[4000] == pytest.approx(4 * ttft[1000])


def test_slowdown_scales_every_time() -> None:
    load = [(i * 0.05, req(f"r{i}", 3000 + 100 * i, 8, base=i)) for i in range(6)]
    fast = simulate(Engine(DEFAULT), load)
    slow = simulate(Engine(replace(DEFAULT, slowdown=2.5)), [(2.5 * at, r) for at, r in load])
    for rid, t in fast.items():
        assert slow[rid].first == pytest.approx(2.5 * t.first)
        assert slow[rid].finish == pytest.approx(2.5 * t.finish)


def test_the_reported_queue_is_what_the_last_step_left_waiting() -> None:
    # vLLM's num_requests_waiting is made after each step's schedule: a request that arrives during
    # a step is not counted until a schedule leaves it out.
    engine = Engine(replace(DEFAULT, max_num_seqs=2))
    for i in range(3):
        engine.add(req(f"r{i}", 100, 4, base=i))
    assert (engine.num_waiting, engine.reported_waiting) == (3, 0)  # no step yet
    plan = engine.schedule()
    assert plan is not None and engine.reported_waiting == 1
    engine.add(req("late", 100, 4, base=9))  # arrives while the step runs
    assert (engine.num_waiting, engine.reported_waiting) == (2, 1)
    engine.update(plan)
    engine.schedule()
    assert engine.reported_waiting == 2
    engine.abort("late")
    assert engine.reported_waiting == 1  # never more than are waiting


def test_requests_beyond_max_num_seqs_wait_fifo() -> None:
    engine = Engine(replace(DEFAULT, max_num_seqs=2))
    for i in range(5):
        engine.add(req(f"r{i}", 100, 4, base=i))
    plan = engine.schedule()
    assert plan is not None
    assert [rid for rid, _ in plan.prefill] == ["r0", "r1"]
    assert (engine.num_running, engine.num_waiting) == (2, 3)
    # Over a whole run, the waiting requests are admitted strictly in arrival order, as slots free up.
    load = [(0.0, req(f"r{i}", 100, 4, base=i)) for i in range(5)]
    timelines = simulate(Engine(replace(DEFAULT, max_num_seqs=2)), load)
    firsts = [timelines[f"r{i}"].first for i in range(5)]
    assert firsts == sorted(firsts)
    assert firsts[2] > timelines["r0"].finish


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = Engine(replace(DEFAULT, max_num_batched_tokens=2048))
    engine.add(req("long", 5000, 2))
    chunks = []
    for _ in range(3):
        plan = engine.schedule()
        assert plan is not None
        chunks.append(plan.prefill_tokens)
        engine.update(plan)
    assert chunks == [2048, 2048, 904]
    # A decoding request and a new long prompt share the budget: decode first, prefill fills the rest.
    engine.add(req("next", 5000, 2, base=1))
    plan = engine.schedule()
    assert plan is not None
    assert plan.decode == ("long",)
    assert plan.prefill_tokens + plan.decode_tokens == 2048


def test_abort_frees_slot_and_kv() -> None:
    engine = Engine(replace(DEFAULT, max_num_seqs=1))
    engine.add(req("a", 1000))
    engine.add(req("b", 1000, base=1))
    plan = engine.schedule()
    assert plan is not None
    assert engine.pool.num_used > 0 and engine.num_waiting == 1
    assert engine.abort("a")
    assert engine.pool.num_used == 0 and engine.num_running == 0
    assert engine.update(plan) == []  # the step's work for "a" is dropped
    plan = engine.schedule()
    assert plan is not None and plan.prefill == (("b", 1000),)
    assert not engine.abort("a") and engine.abort("b") and not engine.has_work()


def test_waiting_request_is_held_until_its_kv_fits() -> None:
    cfg = replace(DEFAULT, num_kv_blocks=100)  # 1,600 tokens
    timelines = simulate(Engine(cfg), [(0.0, req("a", 1000, 8)), (0.0, req("b", 1000, 8, base=1))])
    assert timelines["b"].first > timelines["a"].finish
    with pytest.raises(ValueError, match="KV blocks"):
        Engine(cfg).add(req("huge", 2000))


def test_kv_usage_grows_with_prefill_and_decode() -> None:
    engine = Engine(replace(DEFAULT, num_kv_blocks=1000, max_num_batched_tokens=512))
    engine.add(req("a", 1024, 40))
    usage = []
    while engine.step() is not None:
        usage.append(engine.kv_usage)
        if not engine.has_work():
            break
    assert usage[0] == pytest.approx(32 / 999)  # one 512-token chunk; block 0 is the null block
    assert max(usage) == pytest.approx(-(-(1024 + 40) // 16) / 999)
    assert engine.kv_usage == 0.0


def test_prefix_hits_skip_prefill_and_are_counted_in_tokens() -> None:
    cfg = replace(DEFAULT, enable_prefix_caching=True)
    engine = Engine(cfg)
    shared = list(range(4096))
    a = simulate(engine, [(0.0, EngineRequest("a", [*shared, 1, 2, 3], 4))])["a"]
    b = simulate(engine, [(0.0, EngineRequest("b", [*shared, 7, 8, 9], 4))])["b"]
    assert (a.cached, b.cached) == (0, 4096)
    assert b.first < a.first / 5
    assert engine.prefix_queries == 2 * 4099 and engine.prefix_hits == 4096
    # The very same prompt again: all but the last (partial) block is a hit, never the whole prompt.
    c = simulate(engine, [(0.0, EngineRequest("c", shared, 4))])["c"]
    assert c.cached == 4096 - 16


def test_prefix_caching_off_never_hits() -> None:
    engine = Engine(DEFAULT)
    shared = list(range(2048))
    simulate(engine, [(0.0, EngineRequest("a", shared, 2))])
    b = simulate(engine, [(0.0, EngineRequest("b", shared, 2))])["b"]
    assert b.cached == 0 and engine.prefix_queries == 0


def test_lru_eviction_keeps_blocks_in_use() -> None:
    cfg = replace(DEFAULT, enable_prefix_caching=True, num_kv_blocks=41)  # 640 tokens and the null block
    engine = Engine(cfg)
    p1, p2 = [1] * 320, [2] * 320
    simulate(engine, [(0.0, EngineRequest("a", p1, 1))])  # p1's 20 blocks now cached but free
    simulate(engine, [(0.0, EngineRequest("b", p2, 1))])  # fits in the other 20 blocks
    hit = simulate(engine, [(0.0, EngineRequest("c", p1, 1))])["c"]
    assert hit.cached == 304  # still cached: LRU evicted nothing yet
    # A 600-token prompt needs 38 blocks: most cached blocks must go, least recently used first.
    simulate(engine, [(0.0, EngineRequest("d", [3] * 600, 1))])
    miss = simulate(engine, [(0.0, EngineRequest("e", p2, 1))])["e"]
    assert miss.cached == 0
    # While a request runs, its blocks are not evictable: admission of a too-big newcomer waits.
    engine.add(EngineRequest("f", p1, 200))
    engine.add(EngineRequest("g", [4] * 400, 1))
    plan = engine.schedule()
    assert plan is not None and [r for r, _ in plan.prefill] == ["f"] and engine.num_waiting == 1


def test_embedding_requests_finish_after_prefill() -> None:
    t = simulate(Engine(DEFAULT), [(0.0, req("e", 100, 0))])["e"]
    assert t.reason == "stop" and t.tokens == 0 and t.finish > 0


def test_engine_rejects_invalid_requests() -> None:
    engine = Engine(DEFAULT)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(EngineRequest("x", [], 1))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add(EngineRequest("x", [1], -1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(replace(DEFAULT, max_num_seqs=64, max_num_batched_tokens=32))
