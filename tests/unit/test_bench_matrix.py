"""The dispatch matrix's cells build the fleets they describe."""

from __future__ import annotations

from taogate.bench import matrix
from taogate.emulator.metrics import EmulatorMetrics
from taogate.fleet.engine import parse_vllm_metrics


def _cell(name: str) -> matrix.Cell:
    return next(c for c in matrix.FULL if c.name == name)


def test_the_waves_cell_is_a_cold_tight_fleet_with_a_slow_card() -> None:
    cell = _cell("waves, cold, half cache")
    configs = matrix.configs(cell)
    assert [c.slowdown for c in configs] == [1.0, 1.0, 1.0, 2.5]
    assert all(c.max_num_seqs == 8 and c.enable_prefix_caching for c in configs)
    usable = (configs[0].num_kv_blocks - 1) * configs[0].block_size
    hot = cell.hot * (cell.prefix_tokens + cell.question_tokens)
    assert 0.45 * hot < usable < 0.6 * hot  # about half the hot prompts fit
    wl = matrix.workload(cell)
    assert len(wl.requests) == 320 and wl.concurrency == 32  # closed loop: all start together
    assert "max-num-seqs 8" in cell.describe()


def test_a_cell_can_hide_the_cache_shape_and_make_hits_wait_for_the_prefill() -> None:
    hidden = matrix.configs(_cell("waves, cold, half cache, no cache_config_info"))
    assert not hidden[0].cache_config_info
    sample = parse_vllm_metrics(EmulatorMetrics(hidden[0]).render().decode())
    assert sample.cache_config is None
    shown = matrix.configs(_cell("waves, cold, half cache"))[0]
    assert parse_vllm_metrics(EmulatorMetrics(shown).render().decode()).cache_config is not None
    assert all(
        c.hits_after_prefill for c in matrix.configs(_cell("waves, cold, half cache, hits after prefill"))
    )
