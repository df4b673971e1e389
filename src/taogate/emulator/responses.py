"""Response bodies in vLLM's OpenAI-compatible shapes (completions, chat, chunks, usage, embeddings).

Kept as plain dict builders serialised with orjson: cheaper than pydantic models and easy to compare
with vLLM's output field by field. Streams are Server-Sent Events, one ``data: {json}\\n\\n`` per chunk,
terminated by ``data: [DONE]\\n\\n``; with ``stream_options.include_usage`` the last JSON chunk has
``"choices": []`` and the usage.
"""

from __future__ import annotations

import base64
import json
import random
import struct
from collections.abc import Sequence
from typing import Any

import orjson

from taogate.emulator.protocol import Kind

__all__ = [
    "DONE",
    "FINGERPRINT",
    "Response",
    "embedding_body",
    "load_metrics_header",
    "sse",
    "stream_usage",
    "usage",
]

DONE = b"data: [DONE]\n\n"
#: What vLLM puts in ``system_fingerprint`` (its version and a config hash); marked as emulated.
FINGERPRINT = "vllm-0.32.0-emulated"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, details: bool = True
) -> dict[str, Any]:
    """Usage of a non-stream answer; ``prompt_tokens_details`` only with ``details``, as vLLM
    reports it with ``--enable-prompt-tokens-details`` (null otherwise)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": (
            {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
            if details
            else None
        ),
        "completion_tokens_details": None,
    }


def stream_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, details: bool = True
) -> dict[str, Any]:
    """Usage in a stream's chunks: the three counts, and the cached tokens only with ``details``."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def load_metrics_header(requested: str | None, waiting: int, kv_usage: float) -> list[tuple[bytes, bytes]]:
    """vLLM's ``endpoint-load-metrics`` answer to ``endpoint-load-metrics-format: JSON|TEXT`` (on
    non-stream responses only; any other format gets none)."""
    fmt = (requested or "").lower()
    values = {"num_requests_waiting": float(waiting), "kv_cache_usage_perc": float(kv_usage)}
    if fmt == "json":
        text = "JSON " + json.dumps({"named_metrics": values})
    elif fmt == "text":
        text = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in values.items())
    else:
        return []
    return [(b"endpoint-load-metrics", text.encode())]


class Response:
    """Builds the bodies of one completion or chat response (non-stream body and stream chunks),
    key for key as vLLM 0.32 writes them (the fields the emulator does not model are null)."""

    def __init__(self, kind: Kind, request_id: str, model: str, created: int) -> None:
        self.kind = kind
        self.model = model
        self.created = created
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id}"
        self._object = "text_completion" if kind == "completion" else "chat.completion.chunk"

    def full(self, text: str, finish_reason: str | None, usage_: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            choice |= {"stop_reason": None, "token_ids": None, "prompt_logprobs": None}
            choice |= {"prompt_token_ids": None, "routed_experts": None}
            obj = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            message |= {"annotations": None, "audio": None, "function_call": None, "reasoning": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            choice |= {"stop_reason": None, "token_ids": None, "routed_experts": None}
            obj = "chat.completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": usage_,
        }
        if self.kind == "chat":
            body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return body

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self._object, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        fingerprint: bool = False,
        usage_: dict[str, Any] | None = None,
    ) -> bytes:
        """One token's chunk; the finish chunk carries ``stop_reason`` (chat) and, when no usage
        chunk follows, the ``system_fingerprint``; ``usage_``: continuous usage stats."""
        choice: dict[str, Any]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            choice |= {"stop_reason": None, "prompt_token_ids": None, "token_ids": None}
        else:
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        payload = self._head()
        payload["choices"] = [choice]
        if usage_ is not None:
            payload["usage"] = usage_
        if fingerprint:
            payload["system_fingerprint"] = FINGERPRINT
        return sse(payload)

    def role_chunk(self, usage_: dict[str, Any] | None = None) -> bytes:
        """Chat streams open with an empty assistant delta (vLLM sends it with the first output)."""
        delta = {"role": "assistant", "content": ""}
        payload = self._head()
        payload["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if usage_ is not None:
            payload["usage"] = usage_
        payload |= {"prompt_token_ids": None, "prompt_text": None}
        return sse(payload)

    def usage_chunk(self, usage_: dict[str, Any]) -> bytes:
        payload = self._head()
        payload |= {"choices": [], "usage": usage_, "system_fingerprint": FINGERPRINT}
        return sse(payload)


def _vector(token_ids: Sequence[int], dim: int) -> list[float]:
    """A deterministic unit vector per input (same tokens → same vector)."""
    rng = random.Random(hash(tuple(token_ids)))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]


def embedding_body(
    request_id: str, model: str, created: int, inputs: Sequence[Sequence[int]], *, dim: int, as_base64: bool
) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, ids in enumerate(inputs):
        vec = _vector(ids, dim)
        # The OpenAI SDK asks for base64 by default: little-endian float32, base64-encoded.
        embedding: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if as_base64 else vec
        data.append({"index": i, "object": "embedding", "embedding": embedding})
    prompt_tokens = sum(len(ids) for ids in inputs)
    return {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }
