"""The emulator's ASGI application (routing, the small endpoints, lifespan). Its endpoints, vLLM's
OpenAI-compatible server's plus the emulator's controls:

====================================  =========================================================
``GET  /health``                      200 empty body; 503 with the ``unhealthy`` fault
``GET|POST /ping``                    200 empty body (SageMaker's health check, as in vLLM)
``GET  /load``                        ``{"server_load": N}``: requests being served
``GET  /v1/models``                   one model, ``owned_by: "vllm"``, with ``max_model_len``
``GET  /version``                     ``{"version": ...}``
``POST /v1/completions``              text completions, stream or not (see ``generation``)
``POST /v1/chat/completions``         chat completions, stream or not
``POST /v1/embeddings``               deterministic unit vectors (float or base64); 404 when
                                      ``embeddings`` is off, as on a vLLM serving a generative model
``POST /v1/messages``                 the Anthropic Messages API over chat (see ``anthropic``)
``POST /v1/messages/count_tokens``    the prompt's tokens
``POST /v1/responses``                Responses over chat, stored per process (``responses_api``)
``GET  /v1/responses/{id}``           a stored response; ``POST .../cancel``
``POST /tokenize`` / ``/detokenize``  the emulator's tokenizer (see ``tokenizer``)
``GET  /metrics``                     Prometheus text, vLLM metric names
``GET|POST /emulator/faults``         read / merge run-time faults
``GET  /emulator/stats``              counters and recent request records
====================================  =========================================================

Where it still differs from vLLM on the wire, and why: ``conformance``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from taogate.emulator.anthropic import handle_count_tokens, handle_messages
from taogate.emulator.asgi import header, read_body, send_bytes
from taogate.emulator.clock import Clock
from taogate.emulator.config import EmulatorConfig, FaultsError
from taogate.emulator.errors import ApiError
from taogate.emulator.generation import handle_embeddings, handle_generation
from taogate.emulator.instance import EmulatorInstance
from taogate.emulator.metrics import CONTENT_TYPE
from taogate.emulator.protocol import parse_chat, parse_completion, parse_json, require_json, tokenize_ids
from taogate.emulator.responses_api import PREFIX, handle_response_item, handle_responses

__all__ = ["VLLM_VERSION", "EmulatorApp", "create_emulator_app"]

# The vLLM release whose protocol this emulates, marked so nobody mistakes it for the real thing.
VLLM_VERSION = "0.32.0+taogate.emulator"
_NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's shape, which is what vLLM answers for unknown paths

Handler = Callable[[EmulatorInstance, Scope, Receive, Send], Awaitable[None]]


def _json(payload: Any) -> bytes:
    return orjson.dumps(payload)


async def _health(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 503 if inst.faults.unhealthy else 200, b"", content_type=None)


async def _ping(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 503 if inst.faults.unhealthy else 200, b"", content_type=None)


async def _load(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 200, _json({"server_load": inst.book.in_flight}))


async def _models(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    c = inst.config
    card = {
        "id": c.model,
        "object": "model",
        "created": inst.created,
        "owned_by": "vllm",
        "root": c.model,
        "parent": None,
        "max_model_len": c.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{inst.created:016x}",
                "object": "model_permission",
                "created": inst.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    await send_bytes(send, 200, _json({"object": "list", "data": [card]}))


async def _version(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 200, _json({"version": VLLM_VERSION}))


async def _metrics(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    if inst.faults.metrics_delay > 0:
        await inst.clock.sleep(inst.faults.metrics_delay)
    await send_bytes(send, 200, inst.metrics_text(), content_type=CONTENT_TYPE.encode())


async def _stats(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 200, _json(inst.stats()))


async def _json_body(scope: Scope, receive: Receive, *, strict: bool = True) -> dict[str, Any] | None:
    """The JSON object body; ``strict``: refused unless sent as application/json (vLLM's check)."""
    body = await read_body(receive)
    if body is None:
        return None
    if strict:
        require_json(header(scope, b"content-type"))
    return parse_json(body)


async def _faults(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["method"] == "POST":
        update = await _json_body(scope, receive, strict=False)
        if update is None:
            return
        try:
            inst.faults.merge(update)
        except FaultsError as exc:
            raise ApiError(400, str(exc)) from None
    await send_bytes(send, 200, _json(inst.faults.as_dict()))


async def _tokenize(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    payload = await _json_body(scope, receive)
    if payload is None:
        return
    ids = tokenize_ids(payload, inst.tokenizer, inst.config)
    body = {"count": len(ids), "max_model_len": inst.config.max_model_len, "tokens": ids, "token_strs": None}
    await send_bytes(send, 200, _json(body))


async def _detokenize(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    payload = await _json_body(scope, receive)
    if payload is None:
        return
    tokens = payload.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "`tokens` must be a list of integers", "tokens")
    await send_bytes(send, 200, _json({"prompt": inst.tokenizer.decode(tokens)}))


async def _completions(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_generation(inst, scope, receive, send, parser=parse_completion, kind="completion")


async def _chat(inst: EmulatorInstance, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_generation(inst, scope, receive, send, parser=parse_chat, kind="chat")


_ROUTES: dict[str, tuple[frozenset[str], Handler]] = {
    "/health": (frozenset({"GET"}), _health),
    "/ping": (frozenset({"GET", "POST"}), _ping),
    "/load": (frozenset({"GET"}), _load),
    "/v1/models": (frozenset({"GET"}), _models),
    "/version": (frozenset({"GET"}), _version),
    "/metrics": (frozenset({"GET"}), _metrics),
    "/v1/completions": (frozenset({"POST"}), _completions),
    "/v1/chat/completions": (frozenset({"POST"}), _chat),
    "/v1/embeddings": (frozenset({"POST"}), handle_embeddings),
    "/tokenize": (frozenset({"POST"}), _tokenize),
    "/v1/messages": (frozenset({"POST"}), handle_messages),
    "/v1/messages/count_tokens": (frozenset({"POST"}), handle_count_tokens),
    "/v1/responses": (frozenset({"POST"}), handle_responses),
    "/detokenize": (frozenset({"POST"}), _detokenize),
    "/emulator/faults": (frozenset({"GET", "POST"}), _faults),
    "/emulator/stats": (frozenset({"GET"}), _stats),
}


class EmulatorApp:
    """ASGI 3 callable serving one ``EmulatorInstance`` (reachable as ``app.instance``)."""

    def __init__(self, instance: EmulatorInstance) -> None:
        self.instance = instance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") or "/"
        route = _ROUTES.get(path)
        if route is None and path.startswith(PREFIX):
            route = (frozenset({"GET", "POST", "DELETE"}), handle_response_item)
        if route is None or (path == "/v1/embeddings" and not self.instance.config.embeddings):
            await send_bytes(send, 404, _NOT_FOUND)
            return
        methods, handler = route
        if scope["method"] not in methods:
            allow = ", ".join(sorted(methods)).encode()
            await send_bytes(send, 405, b'{"detail":"Method Not Allowed"}', headers=[(b"allow", allow)])
            return
        try:
            await handler(self.instance, scope, receive, send)
        except ApiError as err:
            await send_bytes(send, err.status, err.body())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:  # bounded by the server: startup, then shutdown
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.instance.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.instance.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_emulator_app(config: EmulatorConfig | None = None, clock: Clock | None = None) -> EmulatorApp:
    """Build the ASGI app of one emulated vLLM instance; its state is ``app.instance``."""
    return EmulatorApp(EmulatorInstance(config or EmulatorConfig(), clock))
