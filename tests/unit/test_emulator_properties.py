"""Invariants of the engine model under random load (hypothesis), checked after every step."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest

_request = st.tuples(
    st.integers(0, 3),  # which shared prefix (so prefix caching gets exercised)
    st.integers(1, 300),  # prompt length
    st.integers(0, 20),  # max_tokens (0 = embedding)
    st.integers(0, 30),  # arrival step
    st.one_of(st.none(), st.integers(0, 40)),  # abort at this step, or never
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(_request, min_size=1, max_size=25),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 256),
    num_kv_blocks=st.integers(24, 80),
    caching=st.booleans(),
)
def test_every_request_ends_and_limits_hold(
    requests: list[tuple[int, int, int, int, int | None]],
    max_num_seqs: int,
    budget: int,
    num_kv_blocks: int,
    caching: bool,
) -> None:
    config = replace(
        EngineConfig.from_emulator(EmulatorConfig()),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(budget, max_num_seqs),
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=caching,
    )
    engine = Engine(config)
    ended: dict[str, str] = {}
    added: set[str] = set()
    for step in range(5_000):  # bounded: a correct engine drains this load in far fewer steps
        for i, (prefix, length, max_tokens, arrive, abort_at) in enumerate(requests):
            rid = f"r{i}"
            if arrive == step:
                prompt = [prefix * 1_000 + t for t in range(length)]
                try:
                    engine.add(EngineRequest(rid, prompt, max_tokens))
                    added.add(rid)
                except ValueError:
                    pass  # larger than the whole cache: refused up front, never stuck
            if abort_at == step and rid in added and rid not in ended and engine.abort(rid):
                ended[rid] = "abort"
        plan = engine.schedule()
        assert engine.num_running <= config.max_num_seqs
        assert engine.pool.num_used <= config.num_kv_blocks
        if plan is not None:
            assert plan.prefill_tokens + plan.decode_tokens <= config.max_num_batched_tokens
            assert plan.duration > 0
            for out in engine.update(plan):
                if out.finish_reason is not None:
                    assert out.request_id not in ended
                    ended[out.request_id] = out.finish_reason
        if step > 40 and not engine.has_work():
            break
    assert set(ended) == added
    assert engine.pool.num_used == 0  # nothing leaks
    assert engine.num_running == engine.num_waiting == 0
