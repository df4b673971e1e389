"""Where the emulator still differs from vLLM 0.32 on the wire, and why: the one list.

The real tier's conformance test (tests/real/test_conformance.py) sends the same requests to the
emulator and to a real vLLM server and compares what matters on the wire: status codes, the headers a
client or the gateway reads, JSON key paths with their types, each stream's sequence of events, error
``type`` and ``param``, ``/metrics`` family and label names. Every difference it sees must be listed
here, and every entry here must still be seen, so the list stays true. ``probe`` names one of the
test's requests (``*``: any of them); ``aspect`` is a glob over what differs there:
``status``, ``header:<name>``, ``keys``, ``events``, ``error``, ``family:<metric>``,
``labels:<metric>``.

The emulator compared is configured as the real card is (``emulated_like_the_real_card``): served
name, context length, batch slots, prefix caching, 128-token blocks, and generate-only (no
embeddings). Its defaults differ from vLLM in two ways on purpose: it serves ``/v1/embeddings``
(tests use it), and it emulates 16-token blocks (see ``EmulatorConfig.block_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIFFERENCES", "Difference"]


@dataclass(frozen=True, slots=True)
class Difference:
    probe: str
    aspect: str
    reason: str


_NOT_EMULATED = "not emulated: the gateway forwards it verbatim, and the real tier tests it on vLLM"
_NO_METRIC = "not emulated: nothing the gateway or the emulator's users read depends on it"

DIFFERENCES: tuple[Difference, ...] = (
    Difference("*", "header:vary", "vLLM's CORS middleware adds `vary: Origin`; no client reads it"),
    # Bodies the emulator models in part.
    Difference(
        "responses",
        "keys",
        "a Response carries the fields clients read; vLLM's engine extras (kv_transfer_params, "
        "input_messages, per-turn token details, ...) are not modelled",
    ),
    # Endpoints only vLLM has.
    Difference("kv_event_sources", "status", "the emulator publishes KV events but has no /kv_event_sources"),
    Difference("kv_event_sources", "keys", "the emulator publishes KV events but has no /kv_event_sources"),
    # Bodies the emulator does not model.
    Difference(
        "completions logprobs",
        "keys",
        "logprobs are not modelled: the emulator's tokens are words drawn from the prompt, not a model's",
    ),
    Difference(
        "chat logprobs",
        "keys",
        "logprobs are not modelled: the emulator's tokens are words drawn from the prompt, not a model's",
    ),
    # Error details below the shape: same status, type and param, a different message text.
    Difference(
        "err n=2 sampling",
        "status",
        "n > 1 is refused by the emulator (one choice per request keeps its streams simple); vLLM samples n",
    ),
    Difference(
        "err n=2 sampling",
        "keys",
        "n > 1 is refused by the emulator (one choice per request keeps its streams simple); vLLM samples n",
    ),
    # /metrics families the emulator has no model for.
    Difference(
        "metrics", "family:http_*", "HTTP server metrics of vLLM's FastAPI instrumentator: " + _NO_METRIC
    ),
    Difference(
        "metrics", "family:process_*", "process metrics: one emulator process may serve many instances"
    ),
    Difference(
        "metrics", "family:python_*", "process metrics: one emulator process may serve many instances"
    ),
    Difference("metrics", "family:vllm:admission_rejections", _NO_METRIC),
    Difference("metrics", "family:vllm:engine_sleep_state", "the emulator has no sleep mode"),
    Difference("metrics", "family:vllm:estimated_*", "FLOPs and memory traffic estimates: " + _NO_METRIC),
    Difference(
        "metrics", "family:vllm:external_prefix_cache_*", "no external (KV-connector) cache is emulated"
    ),
    Difference("metrics", "family:vllm:mm_cache_*", "no multimodal inputs are emulated"),
    Difference("metrics", "family:vllm:iteration_tokens_total", "per-step token counts: " + _NO_METRIC),
    Difference("metrics", "family:vllm:prompt_tokens_by_source", _NO_METRIC),
    Difference("metrics", "family:vllm:prompt_tokens_cached_by_source", _NO_METRIC),
    Difference("metrics", "family:vllm:request_max_num_generation_tokens", _NO_METRIC),
    Difference(
        "metrics", "family:vllm:request_num_preemptions", "the emulator reserves KV and never preempts"
    ),
    Difference("metrics", "family:vllm:request_params_n", "n > 1 is not emulated"),
)
