"""The async driver on a virtual clock: real asyncio plumbing, no real waiting."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from taogate.emulator.clock import VirtualClock
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.driver import Tracked
from taogate.emulator.engine import SeqOutput
from taogate.emulator.instance import EmulatorInstance


def _tracked(inst: EmulatorInstance, rid: str, n: int, max_tokens: int) -> Tracked:
    record = inst.begin(rid, "tag-a", "completion")
    record.prompt_tokens = n
    return Tracked(inst.new_engine_id(rid), [hash((rid, i)) % 30_000 for i in range(n)], max_tokens, record)


def _samples(inst: EmulatorInstance) -> dict[tuple[str, str], float]:
    """(sample name, finished_reason or "") -> value; every sample must carry engine="0"."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(inst.metrics_text().decode()):
        for s in family.samples:
            if s.name.startswith("vllm:") and not s.name.endswith("_created"):
                assert s.labels.get("engine") == "0", s
                out[(s.name, s.labels.get("finished_reason", ""))] = s.value
    return out


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
    got = _samples(inst)
    assert got[("vllm:request_success_total", "length")] == 1.0
    assert got[("vllm:prompt_tokens_total", "")] == 4096.0
    # The phases vLLM reports: nothing queued ahead, prefill until the first token, decode after.
    assert got[("vllm:request_queue_time_seconds_sum", "")] == 0.0
    assert got[("vllm:request_prefill_time_seconds_sum", "")] == pytest.approx(t.record.first_token)
    decode = t.record.finish - t.record.first_token
    assert got[("vllm:request_decode_time_seconds_sum", "")] == pytest.approx(decode)
    assert got[("vllm:request_prefill_kv_computed_tokens_sum", "")] == 4096.0
    assert got[("vllm:request_generation_tokens_sum", "")] == 16.0
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
    got = _samples(inst)
    # As in vLLM, the client's abort is not a finish reason; b waited for a's slot all that time.
    assert got[("vllm:request_success_total", "abort")] == 0.0
    assert got[("vllm:request_success_total", "length")] == 1.0
    assert got[("vllm:request_queue_time_seconds_count", "")] == 1.0
    assert got[("vllm:request_queue_time_seconds_sum", "")] > 0.0
    await inst.aclose()
    with pytest.raises(RuntimeError, match="shutting down"):
        inst.driver.submit(_tracked(inst, "c", 5, 1))
