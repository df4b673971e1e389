"""The Anthropic Messages API as the gateway sees it: its error shape, its usage fields, and its
body read as a chat conversation for dispatch.

vLLM serves ``/v1/messages`` by converting it to a chat completion, so the gateway weighs it the
same way: the system blocks become a leading system message (without Claude Code's per-request
billing header, as vLLM strips it), blocks that are not text (tool calls, tool results, thinking)
are counted as the text the chat template renders them into, images as images wherever they are,
and blocks vLLM drops (documents, redacted thinking) not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from mypy_extensions import mypyc_attr

from taogate.dispatch.tokens import MAX_ITEMS
from taogate.errors import ErrorShape, GatewayError

__all__ = ["ANTHROPIC_ERRORS", "BILLING_HEADER", "AnthropicErrors", "chat_view", "usage_counts"]

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

    request_id_aliases = (b"request-id",)

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


#: Claude Code's first system block: a per-request hash that vLLM strips (it would defeat caching).
BILLING_HEADER = "x-anthropic-billing-header"


def _is_billing(block: object) -> bool:
    text = block.get("text") if isinstance(block, Mapping) else block
    return isinstance(text, str) and text.startswith(BILLING_HEADER)


_TEXT = {"type": "text"}  # a part's type


class _View:
    """Converts blocks while its budget of ``MAX_ITEMS`` lasts (as the chat measure reads at most
    that many items); what comes after is left as it is, for the measure to extrapolate over."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def _take(self, content: list[Any]) -> int:
        take = max(0, min(len(content), self.left))
        self.left -= take
        return take

    def system(self, system: object) -> object:
        """System text as vLLM joins it: text blocks only, Claude Code's billing header left out."""
        if isinstance(system, str):
            return None if _is_billing(system) else system
        if not isinstance(system, list):
            return None
        take = self._take(system)
        text = "".join(
            b["text"]
            for b in system[:take]
            if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str)
            if not _is_billing(b)
        )
        if take < len(system):
            return [{**_TEXT, "text": text}, *system[take:]]
        return text or None

    def blocks(self, content: list[Any]) -> list[Any]:
        take = self._take(content)
        return [part for b in content[:take] for part in self.block(b)] + content[take:]

    def block(self, block: object) -> list[object]:
        """One content block as the chat parts vLLM renders it into; none for any other type,
        which vLLM 0.32 drops (documents, redacted thinking, tool references, ...)."""
        if not isinstance(block, Mapping):
            return [block]
        kind = block.get("type")
        if kind in ("text", "image"):
            return [block]
        if kind == "tool_use":
            return [{**_TEXT, "text": _text_of(block.get("name")) + _text_of(block.get("input"))}]
        if kind == "tool_result":
            return self.tool_result(block.get("content"))
        if kind == "thinking":
            return [{**_TEXT, "text": _text_of(block.get("thinking"))}]
        return []

    def tool_result(self, content: object) -> list[object]:
        """A tool's result: its text items joined, its images as images (a screenshot is an image
        to the model, not its base64 as text)."""
        if not isinstance(content, list):
            return [{**_TEXT, "text": _text_of(content)}]
        take = max(1, min(len(content), self.left))
        self.left -= take
        texts: list[str] = []
        images: list[object] = []
        for item in content[:take]:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(_text_of(item.get("text")))
            elif item.get("type") == "image":
                images.append(item)
        return [{**_TEXT, "text": "\n".join(texts)}, *images]

    def message(self, msg: object) -> object | None:
        self.left -= 1
        if not isinstance(msg, Mapping):
            return msg
        content = msg.get("content")
        if msg.get("role") == "system":  # vLLM strips the billing header here too, and drops it if empty
            text = self.system(content)
            return None if text is None else {"role": "system", "content": text}
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
            converted = self.message(msg)
            if converted is not None:
                out.append(converted)
        return out


def chat_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The body as the chat request vLLM turns it into: what dispatch measures and keys by. Its
    work is bounded as the chat measure's is, whatever the number of messages and blocks."""
    view = _View()
    out: list[object] = []
    system = view.system(payload.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = payload.get("messages")
    if isinstance(messages, list):
        out += view.messages(messages)
    chat: dict[str, Any] = {"model": payload.get("model"), "messages": out}
    if "tools" in payload:
        chat["tools"] = payload["tools"]
    return "chat", chat
