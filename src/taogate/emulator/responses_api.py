"""``/v1/responses`` with vLLM's per-process store (``VLLM_ENABLE_RESPONSES_API_STORE=1``).

Like vLLM 0.32: a response's id is the request's ``request_id`` (``resp_<16 hex>`` when it has
none); with the store on, every response not sent with ``"store": false`` is kept, with the
conversation that led to it, for ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``, and never evicted; with it off nothing is kept. An id the store
does not hold gets 404 ``Response with id '<id>' not found.`` (param ``response_id``); cancelling a
finished response gets 400 ``Cannot cancel a synchronous response.``. A stream is
``event: <type>`` / ``data:`` pairs from ``response.created`` to ``response.completed``. A response
cut at ``max_output_tokens`` has the status ``incomplete``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from taogate.emulator.asgi import read_body, send_bytes
from taogate.emulator.errors import bad_request
from taogate.emulator.generation import handle_generation
from taogate.emulator.instance import EmulatorInstance
from taogate.emulator.protocol import GenerationRequest, parse_chat, parse_json
from taogate.emulator.rewrite import Rewrite

__all__ = ["handle_response_item", "handle_responses"]

PREFIX = "/v1/responses/"


def _error(status: int, message: str, param: str | None) -> bytes:
    kind = "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _not_found(response_id: str) -> bytes:
    return _error(404, f"Response with id '{response_id}' not found.", "response_id")


def _input_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    value = payload.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("1 validation error:\n  Field required: input", "body.input")
    out: list[dict[str, Any]] = []
    for item in value:
        if isinstance(item, dict) and isinstance(item.get("role"), str):
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            out.append({"role": item["role"], "content": content if isinstance(content, str) else ""})
    return out


def _message_id(rid: str) -> str:
    """The one message's id, from its response's: the same in every event and in what is stored, as
    vLLM keeps it."""
    return "msg_" + rid[-16:]


def _response(rid: str, payload: dict[str, Any], model: str, status: str, text: str | None) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if text is not None:
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        item: dict[str, Any] = {"id": _message_id(rid), "content": [part], "role": "assistant"}
        output.append({**item, "status": "completed", "type": "message"})
    return {
        "id": rid,
        "created_at": int(time.time()),
        "instructions": payload.get("instructions"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "background": False,
        "max_output_tokens": payload.get("max_output_tokens"),
        "previous_response_id": payload.get("previous_response_id"),
        "status": status,
        "usage": None,
    }


class _Converter(Rewrite):
    """The chat answer rewritten into a Response as it is sent; stored when done."""

    def __init__(
        self, inst: EmulatorInstance, send: Send, rid: str, payload: dict[str, Any], model: str
    ) -> None:
        super().__init__(send, payload.get("stream") is True)
        self._inst, self._rid, self._payload, self._model = inst, rid, payload, model
        self._text: list[str] = []
        self._reason: str | None = None
        self._seq = 0
        self.messages: list[dict[str, Any]] = []  # the conversation, stored with the response
        self.store = False

    def whole(self, body: bytes) -> bytes:
        chat = orjson.loads(body)
        return orjson.dumps(
            self._finish(
                chat["choices"][0]["message"].get("content") or "",
                chat.get("usage"),
                chat["choices"][0].get("finish_reason"),
            )
        )

    def _finish(self, text: str, usage: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        # A response cut at max_output_tokens is "incomplete", as vLLM reports it.
        status = "incomplete" if reason == "length" else "completed"
        response = _response(self._rid, self._payload, self._model, status, text)
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            response["usage"] = {
                "input_tokens": usage.get("prompt_tokens", 0),
                "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
                "output_tokens": usage.get("completion_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.get("total_tokens", 0),
            }
        if self.store:
            conversation = [*self.messages, {"role": "assistant", "content": text}]
            self._inst.responses[self._rid] = (response, conversation)
        return response

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {**fields, "sequence_number": self._seq, "type": kind}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def events(self, body: bytes) -> list[bytes]:
        out: list[bytes] = []
        item = {"id": _message_id(self._rid), "content": [], "role": "assistant"}
        where = {"content_index": 0, "item_id": item["id"], "output_index": 0}
        for raw in body.split(b"\n\n"):
            if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            chunk = orjson.loads(raw[6:])
            if self._seq == 0:
                started = _response(self._rid, self._payload, self._model, "in_progress", None)
                out.append(self._event("response.created", response=started))
                out.append(self._event("response.in_progress", response=started))
                out.append(
                    self._event(
                        "response.output_item.added",
                        item={**item, "status": "in_progress", "type": "message"},
                        output_index=0,
                    )
                )
                part = {"annotations": [], "text": "", "type": "output_text"}
                out.append(self._event("response.content_part.added", **where, part=part))
            choices = chunk.get("choices") or []
            text = (choices[0].get("delta") or {}).get("content") if choices else None
            if choices and choices[0].get("finish_reason"):
                self._reason = choices[0]["finish_reason"]
            if text:
                self._text.append(text)
                out.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
            if not choices and "usage" in chunk:
                whole = "".join(self._text)
                done = self._finish(whole, chunk["usage"], self._reason)
                out.append(self._event("response.output_text.done", **where, text=whole, logprobs=[]))
                part = {"annotations": [], "text": whole, "type": "output_text"}
                out.append(self._event("response.content_part.done", **where, part=part))
                out.append(self._event("response.output_item.done", item=done["output"][0], output_index=0))
                out.append(self._event("response.completed", response=done))
        return out


async def handle_responses(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    body = await read_body(receive)
    if body is None:
        return
    payload = parse_json(body)
    rid = payload.get("request_id")
    rid = rid if isinstance(rid, str) and rid else "resp_" + os.urandom(8).hex()
    messages = _input_messages(payload)
    if isinstance(payload.get("instructions"), str):
        messages.insert(0, {"role": "system", "content": payload["instructions"]})
    chat: dict[str, Any] = {"model": payload.get("model"), "messages": messages}
    if isinstance(payload.get("max_output_tokens"), int):
        chat["max_tokens"] = payload["max_output_tokens"]
    if payload.get("stream") is True:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    req = parse_chat(chat, inst.tokenizer, inst.config)  # the model is checked first, as vLLM does
    previous = payload.get("previous_response_id")
    if isinstance(previous, str) and previous:
        stored = inst.responses.get(previous) if inst.config.responses_store else None
        if stored is None:
            await send_bytes(send, 404, _not_found(previous))
            return
        messages = [*stored[1], *messages]
        req = parse_chat({**chat, "messages": messages}, inst.tokenizer, inst.config)
    converter = _Converter(inst, send, rid, payload, req.model)
    converter.messages = messages
    converter.store = inst.config.responses_store and payload.get("store") is not False
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    def parser(*_: Any) -> GenerationRequest:
        return req

    await handle_generation(inst, scope, replay, converter, parser=parser, kind="chat")


async def handle_response_item(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
    rest = scope["path"][len(PREFIX) :].rstrip("/").split("/")
    method = scope["method"]
    cancel = len(rest) == 2 and rest[1] == "cancel"
    if len(rest) > 2 or (len(rest) == 2 and not cancel):
        await send_bytes(send, 404, b'{"detail":"Not Found"}')
        return
    if (method != "POST") if cancel else (method != "GET"):
        await send_bytes(send, 405, b'{"detail":"Method Not Allowed"}')
        return
    stored = inst.responses.get(rest[0]) if inst.config.responses_store else None
    if stored is None:
        await send_bytes(send, 404, _not_found(rest[0]))
    elif cancel:
        await send_bytes(send, 400, _error(400, "Cannot cancel a synchronous response.", "response_id"))
    else:
        await send_bytes(send, 200, orjson.dumps(stored[0]))
