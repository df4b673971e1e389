"""The Anthropic Messages API as the gateway sees it: its error shape, its usage fields, and its
body read as a chat conversation for dispatch.

vLLM serves ``/v1/messages`` by converting it to a chat completion, so the gateway weighs it the
same way: the system blocks become a leading system message, and blocks that are not text (tool
calls, tool results, thinking) are counted as the text the chat template renders them into.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from taogate.errors import ErrorShape, GatewayError

__all__ = ["ANTHROPIC_ERRORS", "AnthropicErrors", "chat_view", "usage_counts"]

#: Anthropic's error ``type`` for each status the gateway answers with; the SDK picks its exception
#: class from the status alone, the type fills ``e.type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _body(message: str, status: int) -> bytes:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


class AnthropicErrors(ErrorShape):
    """``{"type": "error", "error": {"type", "message"}}``; a stream ends with ``event: error``."""

    def body(self, exc: GatewayError) -> bytes:
        return _body(exc.message, exc.status)

    def stream_end(self, message: str, code: str) -> bytes:
        return b"event: error\ndata: " + _body(message, 502) + b"\n\n"


ANTHROPIC_ERRORS = AnthropicErrors()


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, output tokens, cached tokens) from an Anthropic usage object.

    ``input_tokens`` leaves out what the prefix cache served (read or created), so the prompt the
    engine saw is the sum of the three."""
    if usage is None:
        return None, None, None
    given = usage.get("input_tokens")
    if not isinstance(given, int):
        return None, None, None
    read = usage.get("cache_read_input_tokens")
    cached = _int(read)
    created = _int(usage.get("cache_creation_input_tokens"))
    output = usage.get("output_tokens")
    said = read is not None
    return given + cached + created, output if isinstance(output, int) else None, cached if said else None


def _text_of(value: object) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode() if value is not None else ""


def _block(block: object) -> object:
    """One content block as the chat part it is rendered as."""
    if not isinstance(block, Mapping):
        return block
    kind = block.get("type")
    if kind in ("text", "image"):
        return block
    if kind == "tool_use":
        return {"type": "text", "text": _text_of(block.get("name")) + _text_of(block.get("input"))}
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return {"type": "text", "text": "".join(_text_of(b.get("text", b)) for b in content if b)}
        return {"type": "text", "text": _text_of(content)}
    if kind == "thinking":
        return {"type": "text", "text": _text_of(block.get("thinking"))}
    return {"type": "text", "text": _text_of(block)}


def _message(msg: object) -> object:
    if not isinstance(msg, Mapping):
        return msg
    content = msg.get("content")
    if not isinstance(content, list) or all(
        isinstance(b, Mapping) and b.get("type") == "text" for b in content
    ):
        return msg
    return {"role": msg.get("role"), "content": [_block(b) for b in content]}


def chat_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The body as the chat request vLLM turns it into: what dispatch measures and keys by."""
    messages = payload.get("messages")
    out: list[object] = [_message(m) for m in messages] if isinstance(messages, list) else []
    system = payload.get("system")
    if isinstance(system, str | list) and system:
        content = system if isinstance(system, str) else [_block(b) for b in system]
        out.insert(0, {"role": "system", "content": content})
    view: dict[str, Any] = {"model": payload.get("model"), "messages": out}
    if "tools" in payload:
        view["tools"] = payload["tools"]
    return "chat", view
