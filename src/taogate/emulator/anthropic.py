"""``/v1/messages`` and ``/v1/messages/count_tokens``, served the way vLLM 0.32 serves them: the
request is turned into a chat completion, and the chat answer (JSON, or its SSE chunks) into the
Anthropic shapes as they come.

What matches vLLM: Claude Code's billing-header system block is left out of the prompt; the
message ``id`` is the chat completion's; usage counts
``input_tokens = prompt - cached`` with ``cache_read_input_tokens`` only where the chat usage has
cache details; a stream is ``event:``/``data:`` pairs, ``message_start`` (the full prompt as
``input_tokens``), one text block, ``message_delta`` with the final usage, ``message_stop``; no
``ping``. Errors of the request body stay in the OpenAI shape (vLLM validates before its
handler); the handler's own errors (unknown model, prompt too long) are
``{"type": "error", "error": {"type": <vLLM's type>, "message"}}``.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from taogate.emulator.asgi import read_body, send_bytes
from taogate.emulator.errors import ApiError, bad_request
from taogate.emulator.generation import handle_generation
from taogate.emulator.instance import EmulatorInstance
from taogate.emulator.protocol import GenerationRequest, parse_chat, parse_json
from taogate.emulator.rewrite import Rewrite

__all__ = ["handle_count_tokens", "handle_messages"]

_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_block_text(b) for b in value)
    return ""


def _block_text(block: object) -> str:
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return orjson.dumps({"name": block.get("name"), "input": block.get("input")}).decode()
    if kind == "tool_result":
        return _text(block.get("content"))
    if kind == "thinking":
        return str(block.get("thinking", ""))
    return ""


#: Claude Code's per-request system block, which vLLM leaves out of the prompt.
_BILLING = "x-anthropic-billing-header"


def _is_billing(block: object) -> bool:
    return str(block.get("text", "") if isinstance(block, dict) else block).startswith(_BILLING)


def _system_text(value: object) -> str:
    """System text as vLLM joins it, without the billing header's blocks."""
    if isinstance(value, list):
        return "".join(_block_text(b) for b in value if not _is_billing(b))
    return "" if _is_billing(value) else _text(value)


def to_chat(payload: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """The chat request vLLM converts a Messages request into (the fields the emulator acts on)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("1 validation error:\n  Field required: model", "body.model")
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise bad_request("1 validation error:\n  Field required: messages", "body.messages")
    chat: list[dict[str, Any]] = []
    system = _system_text(payload.get("system"))
    if system:
        chat.append({"role": "system", "content": system})
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request("1 validation error:\n  Invalid message", "body.messages")
        if msg["role"] == "system":
            inline = _system_text(msg.get("content"))
            if inline:
                chat.append({"role": "system", "content": inline})
            continue
        chat.append({"role": msg["role"], "content": _text(msg.get("content"))})
    out: dict[str, Any] = {"model": model, "messages": chat}
    if counting:
        return out
    max_tokens = payload.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request("1 validation error:\n  Field required: max_tokens", "body.max_tokens")
    out["max_tokens"] = max_tokens
    stops = payload.get("stop_sequences")
    if isinstance(stops, list):
        out["stop"] = stops
    if payload.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def _anthropic_error(status: int, openai_body: bytes) -> bytes:
    """The handler's error as vLLM's Messages router writes it: vLLM's own type names."""
    try:
        error = orjson.loads(openai_body)["error"]
        kind, message = str(error.get("type")), str(error.get("message"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        kind, message = "InternalServerError", openai_body.decode("utf-8", "replace")
    del status
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = int(usage.get("prompt_tokens") or 0)
    out: dict[str, Any] = {"output_tokens": int(usage.get("completion_tokens") or 0)}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        out["cache_read_input_tokens"] = cached
        prompt -= cached
    return {"input_tokens": max(0, prompt), **out}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class _Converter(Rewrite):
    """The chat answer rewritten into the Messages API's, as it is sent."""

    def __init__(self, send: Send, prompt_tokens: int, stream: bool) -> None:
        super().__init__(send, stream)
        self._prompt = prompt_tokens
        self._started = False  # message_start sent
        self._block = False  # a text block is open
        self._finish = "stop"

    def error(self, status: int, body: bytes) -> bytes:
        return _anthropic_error(status, body)

    def whole(self, body: bytes) -> bytes:
        chat = orjson.loads(body)
        choice = chat["choices"][0]
        out = {
            "id": chat["id"],
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": choice["message"].get("content") or ""}],
            "model": chat["model"],
            "stop_reason": _STOP.get(choice.get("finish_reason") or "stop", "end_turn"),
            "usage": _usage(chat.get("usage")),
        }
        return orjson.dumps(out)

    def events(self, body: bytes) -> list[bytes]:
        out: list[bytes] = []
        for raw in body.split(b"\n\n"):
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:]
            if data == b"[DONE]":
                out.append(_event("message_stop", {"type": "message_stop"}))
                continue
            chunk = orjson.loads(data)
            if not self._started:
                self._started = True
                usage = {"input_tokens": self._prompt, "output_tokens": 0}
                message = {"id": chunk["id"], "type": "message", "role": "assistant", "content": []}
                message |= {
                    "model": chunk["model"],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage,
                }
                out.append(_event("message_start", {"type": "message_start", "message": message}))
            choices = chunk.get("choices") or []
            if not choices:  # the usage chunk: the stream's last word before [DONE]
                out.extend(self._close_block())
                stop = {"stop_reason": _STOP.get(self._finish, "end_turn"), "stop_sequence": None}
                out.append(
                    _event(
                        "message_delta",
                        {"type": "message_delta", "delta": stop, "usage": _usage(chunk.get("usage"))},
                    )
                )
                continue
            text = (choices[0].get("delta") or {}).get("content")
            if text:
                if not self._block:
                    self._block = True
                    start: dict[str, Any] = {"type": "content_block_start"}
                    start["content_block"] = {"type": "text", "text": ""}
                    out.append(_event("content_block_start", {**start, "index": 0}))
                delta: dict[str, Any] = {"type": "content_block_delta"}
                delta["delta"] = {"type": "text_delta", "text": text}
                out.append(_event("content_block_delta", {**delta, "index": 0}))
            if choices[0].get("finish_reason"):
                self._finish = choices[0]["finish_reason"]
        return out

    def _close_block(self) -> list[bytes]:
        if not self._block:
            return []
        self._block = False
        return [_event("content_block_stop", {"type": "content_block_stop", "index": 0})]


async def _payload(receive: Receive) -> dict[str, Any] | None:
    body = await read_body(receive)
    return None if body is None else parse_json(body)


async def handle_messages(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    payload = await _payload(receive)
    if payload is None:
        return
    chat = to_chat(payload)
    try:
        req = parse_chat(chat, inst.tokenizer, inst.config)
    except ApiError as err:
        await send_bytes(send, err.status, _anthropic_error(err.status, err.body()))
        return
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # the generation watches for the client leaving
        sent = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    def parser(*_: Any) -> GenerationRequest:
        return req

    converter = _Converter(send, len(req.prompt_ids), req.stream)
    await handle_generation(inst, scope, replay, converter, parser=parser, kind="chat")


async def handle_count_tokens(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    payload = await _payload(receive)
    if payload is None:
        return
    chat = to_chat(payload, counting=True)
    try:
        req = parse_chat({**chat, "max_tokens": 1}, inst.tokenizer, inst.config)
    except ApiError as err:
        await send_bytes(send, err.status, _anthropic_error(err.status, err.body()))
        return
    n = len(req.prompt_ids)
    await send_bytes(
        send, 200, orjson.dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}})
    )
