"""Workload builders: sizes, uniqueness, arrivals, and the user's JSONL file."""

from __future__ import annotations

from pathlib import Path

import pytest

from taogate.bench.scenarios import fleet_capacity, fleet_configs, instance_capacity, pooled_config
from taogate.bench.workloads import from_file, long_prompts, mixed, salted, shared_prefix, single, unshared
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.tokenizer import Tokenizer


def test_article_prompts_are_about_4096_tokens_with_unique_suffixes() -> None:
    w = long_prompts()
    assert len(w.requests) == 64 and w.concurrency == 16
    assert {r.max_tokens for r in w.requests} == {16}
    assert len({r.prompt for r in w.requests}) == 64
    assert w.requests[5].prompt.endswith("request number 5")
    n = len(Tokenizer().encode(w.requests[0].prompt))
    assert 3900 <= n <= 4200
    assert 3900 <= len(w.requests[0].prompt) / 4 <= 4800  # and ~4 characters per token
    assert len(Tokenizer().encode(single().requests[0].prompt)) == pytest.approx(4096, rel=0.05)
    assert len(w.limited(10).requests) == 10 and w.limited(None) is w


def test_mixed_has_poisson_arrivals_and_twenty_percent_long() -> None:
    w = mixed(2000, rate=50.0, seed=1)
    longs = [r for r in w.requests if r.group == "long"]
    assert 0.17 < len(longs) / 2000 < 0.23
    times = [r.at for r in w.requests]
    assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
    assert w.requests[-1].at == pytest.approx(2000 / 50.0, rel=0.1)
    assert len({r.prompt[:20] for r in w.requests}) == 2000  # no shared cacheable prefix
    assert mixed(10, rate=5.0, seed=3) == mixed(10, rate=5.0, seed=3)


def test_shared_prefix_uses_eight_system_prompts() -> None:
    w = shared_prefix(200, system_tokens=500)
    assert len({r.system for r in w.requests}) == 8
    assert len({r.prompt for r in w.requests}) == 200
    assert all(r.group == f"sys{int(r.group[3:])}" for r in w.requests)


def test_from_file_accepts_strings_and_objects(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('"hello there"\n\n{"prompt": "x", "max_tokens": 3, "system": "be brief"}\n')
    w = from_file(path, concurrency=2)
    assert [r.prompt for r in w.requests] == ["hello there", "x"]
    assert w.requests[1].max_tokens == 3 and w.requests[1].system == "be brief"
    path.write_text('"ok"\n{"nope": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        from_file(path)


def test_salted_prefixes_every_prompt() -> None:
    w = salted(long_prompts(3), "Run B.")
    assert all(r.prompt.startswith("Run B. ") for r in w.requests)
    s = salted(shared_prefix(3), "Run B.")
    assert all(r.system and r.system.startswith("Run B. ") for r in s.requests)


def test_unshared_gives_every_request_a_prefix_of_its_own() -> None:
    tok = Tokenizer()
    for w in (unshared(long_prompts(4), "x"), unshared(shared_prefix(4), "x")):
        heads = [tuple(tok.encode(r.system or r.prompt)[:3]) for r in w.requests]
        assert len(set(heads)) == len(heads) == 4


def test_pooled_bound_sums_the_fleet() -> None:
    configs = fleet_configs(4, {3: 2.5})
    assert [c.slowdown for c in configs] == [1, 1, 1, 2.5]
    pooled = pooled_config(configs)
    base = EmulatorConfig()
    assert pooled.prefill_tokens_per_s == pytest.approx(
        3 * base.prefill_tokens_per_s + base.prefill_tokens_per_s / 2.5
    )
    assert pooled.max_num_seqs == 4 * base.max_num_seqs
    assert pooled.max_num_batched_tokens == 4 * base.max_num_batched_tokens
    assert pooled.slowdown == 1.0
    # A full 2,048-token step at 20k tok/s with 12 ms overhead: 2048 / 0.1144 s.
    assert instance_capacity(base) == pytest.approx(2048 / (0.012 + 2048 / 20000))
    assert fleet_capacity(configs) == pytest.approx(
        3 * instance_capacity(base) + instance_capacity(base) / 2.5
    )
    with pytest.raises(ValueError):
        fleet_configs(2, {5: 2.0})
