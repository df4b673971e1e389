"""Shared helpers for the emulator's loopback tests (not a test module)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from taogate.emulator import EmulatorConfig

# A quick engine: ~1 ms steps, so whole request lifecycles take milliseconds.
FAST = EmulatorConfig(step_overhead=0.001, prefill_tokens_per_s=2_000_000.0, decode_tokens_per_s=1_000_000.0)


def fast_config(**changes: Any) -> EmulatorConfig:
    return replace(FAST, **changes)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; labels must match exactly (order-insensitive),
    ``model_name`` and ``engine`` (vLLM's one engine, ``"0"``) implied."""
    for line in text.splitlines():
        match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if found == {"model_name": "emulated-model", "engine": "0", **labels}:
            return float(match.group(3))
    raise KeyError(f"{name}{labels} not in metrics")
