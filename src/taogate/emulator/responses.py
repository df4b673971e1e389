"""Response bodies in vLLM's OpenAI-compatible shapes (completions, chat, chunks, usage, embeddings).

Kept as plain dict builders serialised with orjson: cheaper than pydantic models and easy to compare
with vLLM's output field by field. Streams are Server-Sent Events, one ``data: {json}\\n\\n`` per chunk,
terminated by ``data: [DONE]\\n\\n``; with ``stream_options.include_usage`` the last JSON chunk has
``"choices": []`` and the usage.
"""

from __future__ import annotations

import base64
import random
import struct
from collections.abc import Sequence
from typing import Any

import orjson

from taogate.emulator.protocol import Kind

__all__ = [
    "DONE",
    "Response",
    "embedding_body",
    "sse",
    "usage",
]

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Usage as vLLM reports it with ``--enable-prompt-tokens-details``."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Response:
    """Builds the bodies of one completion or chat response (non-stream body and stream chunks)."""

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
            obj = "text_completion"
        else:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            }
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion"
        choice["stop_reason"] = None
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_,
            "system_fingerprint": None,
            "prompt_logprobs": None,
        }

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> bytes:
        choice: dict[str, Any]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        choice["stop_reason"] = None
        return sse(
            {
                "id": self.id,
                "object": self._object,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def role_chunk(self) -> bytes:
        """Chat streams open with an empty assistant delta (vLLM sends it with the first output)."""
        return self.chunk("", first=True)

    def usage_chunk(self, usage_: dict[str, Any]) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": self._object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_,
            }
        )


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
