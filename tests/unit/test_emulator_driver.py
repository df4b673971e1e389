"""The async driver on a virtual clock: real asyncio plumbing, no real waiting."""

from __future__ import annotations

import asyncio

import pytest

from taogate.emulator.clock import VirtualClock
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.driver import Tracked
from taogate.emulator.engine import SeqOutput
from taogate.emulator.instance import EmulatorInstance


def _tracked(inst: EmulatorInstance, rid: str, n: int, max_tokens: int) -> Tracked:
    record = inst.begin(rid, "tag-a", "completion")
    record.prompt_tokens = n
    return Tracked(inst.new_engine_id(rid), [hash((rid, i)) % 30_000 for i in range(n)], max_tokens, record)


async def _drain(t: Tracked) -> list[SeqOutput]:
    outs = []
    while True:  # bounded: every request finishes within max_tokens steps or is aborted
        out = await t.queue.get()
        outs.append(out)
        if out.finish_reason is not None:
            return outs


async def test_driver_runs_the_engine_in_virtual_time() -> None:
    clock = VirtualClock()
    inst = EmulatorInstance(EmulatorConfig(), clock)
    t = _tracked(inst, "a", 4096, 16)
    inst.driver.submit(t)
    outs = await asyncio.wait_for(_drain(t), timeout=5)  # real-time guard; virtual time runs ahead
    assert [o.index for o in outs] == list(range(16)) and outs[-1].finish_reason == "length"
    assert t.record.first_token == pytest.approx(2 * (0.012 + 2048 / 20_000))
    assert t.record.first_token is not None
    assert t.record.finish == pytest.approx(t.record.first_token + 15 * (0.012 + 1 / 3200))
    inst.end(t.record)
    stats = inst.stats()
    assert (stats["completed"], stats["generation_tokens"], stats["tags"]) == (1, 16, {"tag-a": 1})
    text = inst.metrics_text().decode()
    assert 'vllm:request_success_total{finished_reason="length",model_name="emulated-model"} 1.0' in text
    assert 'vllm:prompt_tokens_total{model_name="emulated-model"} 4096.0' in text
    await inst.aclose()


async def test_latency_spike_is_added_to_each_step() -> None:
    clock = VirtualClock()
    inst = EmulatorInstance(EmulatorConfig(), clock)
    inst.faults.latency_spike = 1.0
    t = _tracked(inst, "a", 10, 3)
    inst.driver.submit(t)
    await asyncio.wait_for(_drain(t), timeout=5)
    assert t.record.finish == pytest.approx(3 * (1.0 + 0.012) + 10 / 20_000 + 2 / 3200)
    await inst.aclose()


async def test_abort_ends_the_stream_and_frees_the_slot() -> None:
    clock = VirtualClock()
    inst = EmulatorInstance(EmulatorConfig(max_num_seqs=1), clock)
    a, b = _tracked(inst, "a", 100, 1000), _tracked(inst, "b", 100, 2)
    inst.driver.submit(a)
    inst.driver.submit(b)
    first = await asyncio.wait_for(a.queue.get(), timeout=5)
    assert first.index == 0 and inst.engine.num_waiting == 1
    assert inst.driver.abort(a.engine_id)
    assert not inst.driver.abort(a.engine_id)  # exactly one finish per request
    assert (await _drain(a))[-1].finish_reason == "abort"
    assert (await asyncio.wait_for(_drain(b), timeout=5))[-1].finish_reason == "length"
    assert inst.engine.num_running == 0 and inst.engine.pool.num_used == 0
    text = inst.metrics_text().decode()
    assert 'vllm:request_success_total{finished_reason="abort",model_name="emulated-model"} 1.0' in text
    await inst.aclose()
    with pytest.raises(RuntimeError, match="shutting down"):
        inst.driver.submit(_tracked(inst, "c", 5, 1))
