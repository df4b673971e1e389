"""A vLLM-protocol emulator with an honest engine model (no GPU needed).

Speaks vLLM's OpenAI-compatible HTTP protocol (completions, chat, embeddings, tokenize, /metrics with
vLLM's metric names, vLLM's error shape) over a pure scheduler model (continuous batching, chunked
prefill, KV blocks, prefix caching, slow cards), with switchable faults. Start instances in-process
with ``run_fleet`` or as processes with ``python -m taogate.emulator``.

Modules: ``engine`` (scheduler model) · ``kv_cache`` (blocks, prefix cache) · ``driver`` (real-time
loop) · ``tokenizer`` · ``protocol`` / ``responses`` / ``errors`` (wire shapes) · ``generation`` /
``app`` / ``asgi`` (HTTP) · ``instance`` (state + accounting) · ``metrics`` · ``stats`` · ``fleet`` ·
``cli`` · ``config`` · ``clock``.
"""

from taogate.emulator.app import EmulatorApp, create_emulator_app
from taogate.emulator.clock import Clock, SystemClock, VirtualClock
from taogate.emulator.config import EmulatorConfig, Faults
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest
from taogate.emulator.fleet import Fleet, run_fleet
from taogate.emulator.instance import EmulatorInstance

__all__ = [
    "Clock",
    "EmulatorApp",
    "EmulatorConfig",
    "EmulatorInstance",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "Faults",
    "Fleet",
    "SystemClock",
    "VirtualClock",
    "create_emulator_app",
    "run_fleet",
]
