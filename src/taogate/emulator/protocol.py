"""Request parsing for the OpenAI-compatible endpoints: JSON body → validated plain dataclasses.

No pydantic per request on purpose (this emulator is also the "direct" baseline in benchmarks): bodies
are parsed with orjson and only the fields the emulator acts on are checked. Checks and messages follow
vLLM 0.32: unknown model → 404, a prompt beyond ``max_model_len`` → 400, ``max_tokens`` clamped to the
room the prompt leaves; malformed JSON, wrong types and a missing Content-Type are request-validation
400s (see ``errors``), and lax types are coerced as pydantic does (``"stream": "yes"`` streams).
``n > 1`` and batched prompts are refused with 400 (one choice per request keeps streams simple).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.errors import ApiError, bad_request, validation_error
from taogate.emulator.tokenizer import Tokenizer, render_chat

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EmbeddingRequest",
    "GenerationRequest",
    "parse_chat",
    "parse_completion",
    "parse_embedding",
    "parse_json",
    "require_json",
    "tokenize_ids",
]

DEFAULT_MAX_TOKENS = 16

Kind = Literal["completion", "chat"]

# pydantic's lax booleans, which vLLM's request models accept (``"stream": "yes"`` streams).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: frozenset[str]
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[list[int]]
    base64: bool


def _detail(kind: str, loc: str, msg: str, value: Any) -> str:
    """One pydantic error as vLLM prints it inside its ``1 validation error:`` message."""
    return str({"type": kind, "loc": loc, "msg": msg, "input": value})


def require_json(content_type: str | None) -> None:
    """vLLM refuses a JSON endpoint's request unless its media type is ``application/json``."""
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        raise validation_error("Unsupported Media Type: Only 'application/json' is allowed", None)


def parse_json(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise validation_error(_detail("missing", "body", "Field required", "None"), "body")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        loc = f"body.{exc.pos}"
        raise validation_error(_detail("json_invalid", loc, "JSON decode error", exc.msg), loc) from None
    if not isinstance(payload, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise validation_error(_detail("model_attributes_type", "body", msg, type(payload).__name__), "body")
    return payload


def _model(payload: dict[str, Any], config: EmulatorConfig) -> str:
    model = payload.get("model")
    if model is None:
        return config.model  # vLLM serves its default model when none is named
    if model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {config.model}.", "model")
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
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    loc = f"body.{name}"
    msg = "Input should be a valid boolean, unable to interpret input"
    raise validation_error(_detail("bool_parsing", loc, msg, value), loc)


_LAX = {"float": "a number", "int": "an integer"}


def _lax_error(kind: str, name: str, value: Any) -> ApiError:
    """pydantic's lax-mode refusal of ``value`` for a ``kind`` (float or int) field."""
    what = _LAX[kind]
    loc = f"body.{name}"
    msg = f"Input should be a valid {what.split()[1]}, unable to parse string as {what}"
    return validation_error(_detail(f"{kind}_parsing", loc, msg, value), loc)


def _number(payload: dict[str, Any], name: str) -> float | None:
    """A lax float field (a numeric string is accepted, as pydantic does)."""
    value = payload.get(name)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return None if value is None else float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    raise _lax_error("float", name, value)


def _integer(value: Any, name: str) -> int:
    """A lax int field (an integral float or a numeric string is accepted, as pydantic does)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
    raise _lax_error("int", name, value)


def _max_tokens(
    payload: dict[str, Any], names: tuple[str, ...], prompt_len: int, config: EmulatorConfig
) -> int:
    """vLLM's checks: the prompt must fit the context, ``max_tokens`` must be 1..max_model_len,
    and is then clamped to the room the prompt leaves."""
    limit = config.max_model_len
    if prompt_len > limit:
        # vLLM tokenizes with truncation at limit + 1, so it never knows more than "at least" that.
        shown = limit + 1
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains "
            f"at least {shown} input tokens, which exceeds this limit even without any output "
            f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
            f"value={shown})",
            "input_tokens",
        )
    name = next((n for n in names if payload.get(n) is not None), None)
    if name is None:
        return max(1, min(DEFAULT_MAX_TOKENS, limit - prompt_len))
    value = _integer(payload[name], name)
    if value < 1:
        raise bad_request(f"{name} must be at least 1, got {value}. (parameter={name}, value={value})", name)
    if value > limit:
        raise bad_request(
            f"{name}={value} cannot be greater than max_model_len={limit}. Please request fewer "
            f"output tokens. (parameter={name}, value={value})",
            name,
        )
    return max(1, min(value, limit - prompt_len))


def _common(payload: dict[str, Any]) -> tuple[bool, bool, bool, frozenset[str]]:
    temperature = _number(payload, "temperature")
    _number(payload, "top_p")
    n = payload.get("n")
    if n is not None and n != 1:
        if temperature == 0:
            raise bad_request(f"n must be 1 when using greedy sampling, got {n}.")
        raise bad_request("n > 1 is not supported by the emulator", "n")
    stream = _bool(payload, "stream")
    options = payload.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object", "stream_options")
        if options and not stream:  # as vLLM: a gateway adding them to a whole answer is told
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(options.get("include_usage"))
        continuous = bool(options.get("continuous_usage_stats"))
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
    return stream, include_usage, continuous, stops


def parse_completion(
    payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig
) -> GenerationRequest:
    model = _model(payload, config)
    if payload.get("prompt") in (None, "", []):
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"
        )
    ids = _prompt_ids(payload["prompt"], tokenizer, "prompt")
    stream, include_usage, continuous, stop = _common(payload)
    max_tokens = _max_tokens(payload, ("max_tokens",), len(ids), config)
    return GenerationRequest(
        "completion", model, ids, max_tokens, stream, include_usage, stop, continuous and stream
    )


def parse_chat(payload: dict[str, Any], tokenizer: Tokenizer, config: EmulatorConfig) -> GenerationRequest:
    model = _model(payload, config)
    messages = payload.get("messages")
    if messages is None:
        msg = "Field required"
        raise validation_error(_detail("missing", "body.messages", msg, "<dict>"), "body.messages")
    if not isinstance(messages, list):
        msg = "Input should be a valid list"
        raise validation_error(_detail("list_type", "body.messages", msg, messages), "body.messages")
    if not messages:
        raise bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    ids = tokenizer.encode(_render(messages, add_generation_prompt=True))
    stream, include_usage, continuous, stop = _common(payload)
    max_tokens = _max_tokens(payload, ("max_completion_tokens", "max_tokens"), len(ids), config)
    return GenerationRequest(
        "chat", model, ids, max_tokens, stream, include_usage, stop, continuous and stream
    )


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
