"""Emulator configuration: static engine shape (``EmulatorConfig``) and run-time faults (``Faults``).

``EmulatorConfig`` is frozen: it is what a vLLM process is started with. ``Faults`` is deliberately
mutable: tests, chaos scripts and ``POST /emulator/faults`` flip faults while the instance runs.

Default engine numbers: :mod:`taogate.emulator.engine`, and why they are what they are,
benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EmulatorConfig", "Faults", "FaultsError"]


class FaultsError(ValueError):
    """A faults update named an unknown field or carried a value of the wrong kind."""


@dataclass(slots=True)
class Faults:
    """Switchable misbehaviour of one instance; every field off by default.

    - ``error_rate``: fraction (0..1) of generation requests answered with a 500 in vLLM's error shape.
    - ``hang``: accept generation requests and never answer until the client goes away.
    - ``unhealthy``: ``GET /health`` answers 503.
    - ``slow_first_byte``: extra seconds before a generation response starts.
    - ``close_mid_stream``: drop the connection after this many stream chunks (0 = never).
    - ``latency_spike``: extra seconds added to every engine step while set.
    - ``throttle``: every engine step takes this many times its own duration more (a card throttled,
      then recovering when it is set back to 0).
    - ``metrics_delay``: extra seconds before ``GET /metrics`` answers (a busy vLLM renders slowly).
    """

    error_rate: float = 0.0
    hang: bool = False
    unhealthy: bool = False
    slow_first_byte: float = 0.0
    close_mid_stream: int = 0
    latency_spike: float = 0.0
    throttle: float = 0.0
    metrics_delay: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able view (for ``GET /emulator/faults``)."""
        return dataclasses.asdict(self)

    def merge(self, update: dict[str, Any]) -> None:
        """Apply a partial update in place, validating every key first so a bad update changes nothing."""
        known = {f.name: f for f in dataclasses.fields(self)}
        clean: dict[str, Any] = {}
        for key, value in update.items():
            if key not in known:
                raise FaultsError(f"unknown fault {key!r}; known faults: {', '.join(sorted(known))}")
            clean[key] = _coerce(key, value, type(getattr(self, key)))
        for key, value in clean.items():
            setattr(self, key, value)

    def copy(self) -> Faults:
        return dataclasses.replace(self)


def _coerce(key: str, value: Any, kind: type) -> Any:
    # bool is a subclass of int: check it first so `"hang": 1` is refused rather than silently accepted.
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise FaultsError(f"fault {key!r} must be true or false, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultsError(f"fault {key!r} must be a number, got {value!r}")
    if value < 0:
        raise FaultsError(f"fault {key!r} must be >= 0, got {value!r}")
    if key == "error_rate" and value > 1:
        raise FaultsError(f"fault 'error_rate' must be within 0..1, got {value!r}")
    if kind is int:
        if int(value) != value:
            raise FaultsError(f"fault {key!r} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """How one emulated vLLM instance is "started" (mirrors vLLM's CLI flags where one exists)."""

    model: str = "emulated-model"
    max_model_len: int = 32_768
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2_048
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 3_200.0
    step_overhead: float = 0.012
    slowdown: float = 1.0
    enable_prefix_caching: bool = False
    kv_cache_tokens: int = 262_144
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # KV blocks, the null block included (vLLM's flag)
    kv_events_endpoint: str | None = None  # publish vLLM's KV events over ZMQ here (prefix caching on)
    kv_events_topic: str = ""
    kv_events_replay: str | None = None  # a ROUTER endpoint answering replay requests
    instant: bool = False
    # vLLM's --enable-prompt-tokens-details: usage carries prompt_tokens_details (cached tokens).
    enable_prompt_tokens_details: bool = False
    # vLLM's --enable-request-id-headers: responses carry x-request-id.
    enable_request_id_headers: bool = False
    # /v1/embeddings is served (vLLM serving a generative model answers it 404).
    embeddings: bool = True
    embedding_dim: int = 64
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    records_kept: int = 1_000
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE=1: /v1/responses keeps responses
    # /metrics carries vllm:cache_config_info (vLLM always does; off: a server that hides its cache shape).
    cache_config_info: bool = True
    # A prompt's blocks become hittable only once its prefill completes (vLLM caches them when it
    # schedules them, so a follower queued behind its leader hits; some engines and emulators do not).
    hits_after_prefill: bool = False

    def __post_init__(self) -> None:
        positive = {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "slowdown": self.slowdown,
            "kv_cache_tokens": self.kv_cache_tokens,
            "block_size": self.block_size,
            "embedding_dim": self.embedding_dim,
            "records_kept": self.records_kept,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"EmulatorConfig.{name} must be > 0, got {value!r}")
        if self.step_overhead < 0:
            raise ValueError(f"EmulatorConfig.step_overhead must be >= 0, got {self.step_overhead!r}")
        if self.kv_cache_tokens < 2 * self.block_size:
            raise ValueError("EmulatorConfig.kv_cache_tokens must hold at least two blocks")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("EmulatorConfig.num_gpu_blocks_override must be >= 2 (one is the null block)")

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks, vLLM's ``num_gpu_blocks``: the null block included, so one fewer is usable."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return self.kv_cache_tokens // self.block_size
