"""Request parsing for the OpenAI-compatible endpoints: JSON body → validated plain dataclasses.

No pydantic per request on purpose (this emulator is also the "direct" baseline in benchmarks): bodies
are parsed with orjson and only the fields the emulator acts on are checked. Checks and messages follow
vLLM: unknown model → 404, prompt beyond ``max_model_len`` → 400, malformed JSON / missing fields → 400.
``n > 1`` and batched prompts are refused with 400 (one choice per request keeps streams simple).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.errors import ApiError, bad_request
from taogate.emulator.tokenizer import Tokenizer, render_chat

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EmbeddingRequest",
    "GenerationRequest",
    "parse_chat",
    "parse_completion",
    "parse_embedding",
    "parse_json",
    "tokenize_ids",
]

DEFAULT_MAX_TOKENS = 16

Kind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: frozenset[str]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[list[int]]
    base64: bool


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    return payload


def _model(payload: dict[str, Any], config: EmulatorConfig) -> str:
    model = payload.get("model")
    if model is None:
        return config.model  # vLLM serves its default model when none is named
    if model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return config.model


def _token_list(value: Any) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return value
    return None


def _prompt_ids(value: Any, tokenizer: Tokenizer, field: str) -> list[int]:
    """A single prompt: text, or token ids; a one-element batch of either is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        ids = tokenizer.encode(value)
        if not ids:
            raise bad_request(f"`{field}` must contain at least one token", field)
        return ids
    ids_or_none = _token_list(value)
    if ids_or_none is None:
        if isinstance(value, list) and len(value) > 1:
            raise bad_request(
                "batched prompts are not supported by the emulator; send one per request", field
            )
        raise bad_request(f"`{field}` must be a string or a list of token ids", field)
    return ids_or_none


def _bool(payload: dict[str, Any], name: str, default: bool = False) -> bool:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be a boolean", name)
    return value


def _max_tokens(
    payload: dict[str, Any], names: tuple[str, ...], prompt_len: int, config: EmulatorConfig
) -> int:
    limit = config.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "messages" if "max_completion_tokens" in names else "prompt",
        )
    value = next((payload[n] for n in names if payload.get(n) is not None), None)
    if value is None:
        return min(DEFAULT_MAX_TOKENS, limit - prompt_len)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"`{names[-1]}` must be an integer >= 1", names[-1])
    if prompt_len + value > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + value} tokens ({prompt_len} in the messages, {value} in the completion). "
            "Please reduce the length of the messages or completion.",
            names[-1],
        )
    return value


def _common(payload: dict[str, Any]) -> tuple[bool, bool, frozenset[str]]:
    n = payload.get("n")
    if n is not None and n != 1:
        raise bad_request("n > 1 is not supported by the emulator", "n")
    stream = _bool(payload, "stream")
    options = payload.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object", "stream_options")
        include_usage = bool(options.get("include_usage"))
    stop = payload.get("stop")
    if stop is None:
        stops: frozenset[str] = frozenset()
    elif isinstance(stop, str):
        stops = frozenset((stop.strip(),))
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = frozenset(s.strip() for s in stop)
    else:
        raise bad_request("`stop` must be a string or a list of strings", "stop")
    _bool(payload, "ignore_eos")  # accepted (the emulator never emits EOS on its own anyway)
    return stream, include_usage, stops


def parse_completion(
    payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig
) -> GenerationRequest:
    model = _model(payload, config)
    if "prompt" not in payload:
        raise bad_request("`prompt` is required", "prompt")
    ids = _prompt_ids(payload["prompt"], tokenizer, "prompt")
    stream, include_usage, stop = _common(payload)
    max_tokens = _max_tokens(payload, ("max_tokens",), len(ids), config)
    return GenerationRequest("completion", model, ids, max_tokens, stream, include_usage, stop)


def parse_chat(payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig) -> GenerationRequest:
    model = _model(payload, config)
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty list", "messages")
    ids = tokenizer.encode(_render(messages, add_generation_prompt=True))
    stream, include_usage, stop = _common(payload)
    max_tokens = _max_tokens(payload, ("max_tokens", "max_completion_tokens"), len(ids), config)
    return GenerationRequest("chat", model, ids, max_tokens, stream, include_usage, stop)


def _render(messages: list[Any], add_generation_prompt: bool) -> str:
    try:
        return render_chat(messages, add_generation_prompt=add_generation_prompt)
    except (KeyError, TypeError) as exc:
        raise bad_request(f"invalid `messages`: {exc}", "messages") from None


def parse_embedding(
    payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig
) -> EmbeddingRequest:
    model = _model(payload, config)
    if "input" not in payload:
        raise bad_request("`input` is required", "input")
    raw = payload["input"]
    items: list[Any]
    if isinstance(raw, str) or _token_list(raw) is not None:
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise bad_request("`input` must be a string, a list of strings or token-id lists", "input")
    inputs = [_prompt_ids(item, tokenizer, "input") for item in items]
    for ids in inputs:
        if len(ids) > config.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {config.max_model_len} tokens. However, your "
                f"request has {len(ids)} input tokens. Please reduce the length of the input.",
                "input",
            )
    fmt = payload.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("`encoding_format` must be 'float' or 'base64'", "encoding_format")
    return EmbeddingRequest(model, inputs, fmt == "base64")


def tokenize_ids(payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig) -> list[int]:
    """``POST /tokenize`` accepts ``prompt`` (text) or chat ``messages``, as vLLM's endpoint does."""
    _model(payload, config)
    if "messages" in payload:
        messages = payload["messages"]
        if not isinstance(messages, list):
            raise bad_request("`messages` must be a list", "messages")
        add = _bool(payload, "add_generation_prompt", default=True)
        return tokenizer.encode(_render(messages, add_generation_prompt=add))
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("`prompt` (string) or `messages` is required", "prompt")
    return tokenizer.encode(prompt)
