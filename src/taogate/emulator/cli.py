"""``taogate emulate``: run one emulated vLLM server, or a fleet on consecutive ports.

Flags mirror vLLM's where one exists (``--model``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--max-model-len``, ``--enable-prefix-caching``, ``--block-size``, ``--enable-prompt-tokens-details``,
``--enable-request-id-headers``; prefix caching is on unless ``--no-enable-prefix-caching``, as the
README recommends for vLLM); the rest shape the engine model (``--slowdown``,
``--prefill-tps``, ...) or inject faults. ``--fleet N`` starts N instances on ports START..START+N-1
(free ports if START is 0) and ``--slow INDEX=FACTOR`` makes instance INDEX a slow card. Prints
``emulator ready URL`` per instance once listening, logs one line per request (grep the tag), and exits
cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated

import typer

from taogate.emulator.config import EmulatorConfig, Faults
from taogate.emulator.fleet import run_fleet
from taogate.emulator.kv_events import offset_endpoint
from taogate.serving import loop_factory

__all__ = ["build_configs", "emulate", "parse_slow"]


def parse_slow(specs: Sequence[str], fleet_size: int) -> dict[int, float]:
    """``["3=2.5"]`` → ``{3: 2.5}``; indices must fall inside the fleet, factors must be > 0."""
    out: dict[int, float] = {}
    for spec in specs:
        index_text, sep, factor_text = spec.partition("=")
        try:
            if not sep:
                raise ValueError
            index, factor = int(index_text), float(factor_text)
        except ValueError:
            raise typer.BadParameter(f"expected INDEX=FACTOR, got {spec!r}", param_hint="--slow") from None
        if not 0 <= index < fleet_size:
            raise typer.BadParameter(
                f"index {index} is outside the fleet (0..{fleet_size - 1})", param_hint="--slow"
            )
        if factor <= 0:
            raise typer.BadParameter(f"factor must be > 0, got {factor}", param_hint="--slow")
        out[index] = factor
    return out


def build_configs(base: EmulatorConfig, fleet: int, slow: Sequence[str]) -> list[EmulatorConfig]:
    """One config per instance (``fleet`` 0 or 1 → one), each with its own seed and slowdown."""
    count = max(1, fleet)
    factors = parse_slow(slow, count)
    return [
        replace(
            base,
            seed=base.seed + i,
            slowdown=factors.get(i, base.slowdown),
            faults=base.faults.copy(),
            kv_events_endpoint=offset_endpoint(base.kv_events_endpoint, i),
            kv_events_replay=offset_endpoint(base.kv_events_replay, i),
        )
        for i in range(count)
    ]


async def _serve(configs: list[EmulatorConfig], host: str, ports: list[int]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with run_fleet(configs, host=host, ports=ports) as fleet:
            for url in fleet.urls:
                print(f"emulator ready {url}", flush=True)
            await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def emulate(
    *,
    port: Annotated[int, typer.Option(help="Port (first port with --fleet; 0 = free ports).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    fleet: Annotated[int, typer.Option(help="Start N instances on consecutive ports.", min=0)] = 0,
    model: Annotated[str, typer.Option(help="Served model name.")] = "emulated-model",
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Max requests running at once.")] = 32,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Token budget per engine step.")] = 2048,
    max_model_len: Annotated[int, typer.Option(min=1, help="Context length.")] = 32_768,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            help="Reuse the KV of shared prompt prefixes (on, as recommended for vLLM and as bench assumes)."
        ),
    ] = True,
    slowdown: Annotated[float, typer.Option(min=0.01, help="Multiply every step's duration.")] = 1.0,
    prefill_tps: Annotated[float, typer.Option(min=1, help="Prefill speed, tokens/s.")] = 20_000.0,
    decode_tps: Annotated[float, typer.Option(min=1, help="Decode cost, tokens/s per batch.")] = 3_200.0,
    step_overhead: Annotated[float, typer.Option(min=0, help="Fixed seconds per engine step.")] = 0.012,
    kv_cache_tokens: Annotated[int, typer.Option(min=16, help="KV-cache capacity in tokens.")] = 262_144,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block (vLLM on CPU: 128).")] = 16,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(min=2, help="KV blocks, the null block included (overrides the tokens).")
    ] = None,
    kv_events_endpoint: Annotated[
        str | None, typer.Option(help="Publish KV events over ZMQ (vLLM's wire; needs prefix caching).")
    ] = None,
    kv_events_topic: Annotated[str, typer.Option(help="Topic of the KV events.")] = "",
    kv_events_replay: Annotated[str | None, typer.Option(help="ZMQ ROUTER endpoint for replays.")] = None,
    enable_prompt_tokens_details: Annotated[
        bool, typer.Option(help="usage carries prompt_tokens_details.cached_tokens.")
    ] = False,
    enable_request_id_headers: Annotated[bool, typer.Option(help="Answers carry x-request-id.")] = False,
    embeddings: Annotated[
        bool, typer.Option(help="Serve /v1/embeddings (vLLM: pooling models only).")
    ] = True,
    instant: Annotated[bool, typer.Option(help="Bypass the engine: answer at once.")] = False,
    slow: Annotated[list[str] | None, typer.Option(help="INDEX=FACTOR: slow card in the fleet.")] = None,
    error_rate: Annotated[float, typer.Option(min=0, max=1, help="Fraction answered with 500.")] = 0.0,
    hang: Annotated[bool, typer.Option(help="Never answer generation requests.")] = False,
    unhealthy: Annotated[bool, typer.Option(help="/health answers 503.")] = False,
    slow_first_byte: Annotated[float, typer.Option(min=0, help="Extra seconds before a response.")] = 0.0,
    close_mid_stream: Annotated[int, typer.Option(min=0, help="Drop streams after N chunks.")] = 0,
    latency_spike: Annotated[float, typer.Option(min=0, help="Extra seconds per engine step.")] = 0.0,
    metrics_delay: Annotated[float, typer.Option(min=0, help="Extra seconds before /metrics answers.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for the error-rate fault.")] = 0,
    log_level: Annotated[str, typer.Option(help="Log level (request lines are INFO).")] = "info",
) -> None:
    """Run an emulated vLLM OpenAI-compatible server (or a fleet of them) on 127.0.0.1."""
    faults = Faults(
        error_rate=error_rate,
        hang=hang,
        unhealthy=unhealthy,
        slow_first_byte=slow_first_byte,
        close_mid_stream=close_mid_stream,
        latency_spike=latency_spike,
        metrics_delay=metrics_delay,
    )
    try:
        base = EmulatorConfig(
            model=model,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_tokens_per_s=prefill_tps,
            decode_tokens_per_s=decode_tps,
            step_overhead=step_overhead,
            slowdown=slowdown,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_tokens=kv_cache_tokens,
            block_size=block_size,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            enable_request_id_headers=enable_request_id_headers,
            embeddings=embeddings,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic=kv_events_topic,
            kv_events_replay=kv_events_replay,
            instant=instant,
            faults=faults,
            seed=seed,
            responses_store=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE") == "1",
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    configs = build_configs(base, fleet, slow or [])
    ports = [0 if port == 0 else port + i for i in range(len(configs))]
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve(configs, host, ports))
