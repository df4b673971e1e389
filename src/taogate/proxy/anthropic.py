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
from mypy_extensions import mypyc_attr

from taogate.dispatch.tokens import MAX_ITEMS
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


@mypyc_attr(native_class=False)
class AnthropicErrors(ErrorShape):
    """``{"type": "error", "error": {"type", "message"}}``; a stream ends with ``event: error``."""

    def body(self, exc: GatewayError) -> bytes:
        return _body(exc.message, exc.status)

    def stream_end(self, message: str, code: str) -> bytes:
        return b"event: error\ndata: " + _body(message, 502) + b"\n\n"

    def refusal(self, status: int, code: str, message: str) -> bytes:
        return _body(message, status)


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


class _View:
    """Converts blocks while its budget of ``MAX_ITEMS`` lasts (as the chat measure reads at most
    that many items); what comes after is left as it is, for the measure to extrapolate over."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def blocks(self, content: list[Any]) -> list[Any]:
        take = max(0, min(len(content), self.left))
        self.left -= take
        return [self.block(b) for b in content[:take]] + content[take:]

    def block(self, block: object) -> object:
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
                take = max(1, min(len(content), self.left))
                self.left -= take
                return {
                    "type": "text",
                    "text": "".join(_text_of(_text_field(b)) for b in content[:take] if b),
                }
            return {"type": "text", "text": _text_of(content)}
        if kind == "thinking":
            return {"type": "text", "text": _text_of(block.get("thinking"))}
        return {"type": "text", "text": _text_of(block)}

    def message(self, msg: object) -> object:
        self.left -= 1
        if not isinstance(msg, Mapping):
            return msg
        content = msg.get("content")
        if not isinstance(content, list) or all(
            isinstance(b, Mapping) and b.get("type") == "text" for b in content[: max(1, self.left)]
        ):
            return msg
        return {"role": msg.get("role"), "content": self.blocks(content)}

    def messages(self, messages: list[Any]) -> list[Any]:
        out: list[Any] = []
        for i, msg in enumerate(messages):
            if self.left <= 0:
                return out + messages[i:]
            out.append(self.message(msg))
        return out


def _text_field(item: object) -> object:
    """A tool result's item: its ``text`` when it is a block, else the item itself."""
    return item.get("text", item) if isinstance(item, Mapping) else item


def chat_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The body as the chat request vLLM turns it into: what dispatch measures and keys by. Its
    work is bounded as the chat measure's is, whatever the number of messages and blocks."""
    view = _View()
    out: list[object] = []
    system = payload.get("system")
    if isinstance(system, str | list) and system:
        out.append({"role": "system", "content": system if isinstance(system, str) else view.blocks(system)})
    messages = payload.get("messages")
    if isinstance(messages, list):
        out += view.messages(messages)
    chat: dict[str, Any] = {"model": payload.get("model"), "messages": out}
    if "tools" in payload:
        chat["tools"] = payload["tools"]
    return "chat", chat
