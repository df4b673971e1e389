"""The ext_proc stream: one per HTTP request, message by message.

::

    request headers  → route, key (401 at once), held unanswered while the body comes
    request body     → gathered; at its end the key's limits and the pick: the headers' answer
                       (destination, header changes, cleared route cache), then the body handed
                       back, in chunks
    response headers → the tap; x-taogate-instance, the request id and the key's x-ratelimit-*
                       for the client
    response body    → each chunk handed back as it came, and through the tap
    (stream closed)  → the tap releases the lease if the response did not end

Refusals (401, 404, 413, 429, 503...) are immediate responses in the route's error shape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from taogate.errors import OPENAI_ERRORS, GatewayError, NoInstance, Unauthorized
from taogate.gateway import Gateway
from taogate.picker import encoding
from taogate.picker.admit import Admission, Answer, Refused, error_answer, refused, route_method
from taogate.picker.hints import served_endpoint, subset_hint
from taogate.picker.tap import Tap
from taogate.proxy.auth import header
from taogate.proxy.intake import request_id
from taogate.proxy.routes import Route
from taogate.request_record import RequestRecord
from taogate.tenancy.keys import Tenant

__all__ = ["Picker"]

log = logging.getLogger("taogate.picker")


class Picker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor``: answers each stream with a ``_Stream``."""

    def __init__(self, gateway: Gateway, admission: Admission) -> None:
        self.gateway = gateway
        self.admission = admission

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        stream = _Stream(self.gateway, self.admission)
        try:
            async for message in requests:
                for answer in await stream.handle(message):
                    yield answer
        finally:
            stream.close()


class _Stream:
    """One request's state across its messages."""

    __slots__ = (
        "_admission",
        "_body",
        "_gateway",
        "_headers",
        "_over",
        "_path",
        "_rec",
        "_route",
        "_subset",
        "_tap",
        "_tenant",
        "done",
    )

    def __init__(self, gateway: Gateway, admission: Admission) -> None:
        self._gateway = gateway
        self._admission = admission
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._over = 0  # bytes gathered so far
        self._path = ""
        self._route: Route | None = None
        self._rec: RequestRecord | None = None
        self._subset: frozenset[str] | None = None
        self._tap: Tap | None = None
        self._tenant: Tenant | None = None
        self.done = False  # answered without an upstream

    async def handle(self, message: Any) -> list[Any]:
        kind = message.WhichOneof("request")
        if self.done:
            return []
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body.body, message.request_body.end_of_stream)
        if kind == "request_trailers":
            answers = await self._request_body(b"", True, trailers=True) if self._tap is None else []
            return [*answers, encoding.trailers_answer(response=False)]
        tap = self._tap
        if tap is None:  # a response with no pick (the gateway's own answer): pass it on
            return _pass(message, kind)
        if kind == "response_headers":
            raw = encoding.decode_headers(message.response_headers)
            set_headers, remove = tap.headers(raw, served_endpoint(message.metadata_context))
            if message.response_headers.end_of_stream:
                tap.end()
            return [encoding.headers_answer(set_headers, remove)]
        if kind == "response_body":
            body = message.response_body
            tap.body(body.body)
            if body.end_of_stream:
                tap.end()
            return [encoding.body_echo(body.body, body.end_of_stream)]
        if kind == "response_trailers":
            tap.end()
            return [encoding.trailers_answer(response=True)]
        return []

    async def _request_headers(self, message: Any) -> list[Any]:
        gw = self._gateway
        headers = encoding.decode_headers(message.request_headers)
        self._headers = headers
        path = (header(headers, b":path") or b"/").decode("latin-1")
        method = route_method(headers)
        self._path = path
        rid = request_id(header(headers, b"x-request-id"))
        admission = self._admission
        self._subset = subset_hint(message.metadata_context if message.HasField("metadata_context") else None)
        if admission.is_models(method, path.partition("?")[0]):
            try:
                admission.authorize(None, headers)
            except Unauthorized as exc:
                gw.metrics.rejections.labels("auth").inc()
                return [self._immediate(error_answer(OPENAI_ERRORS, exc, rid))]
            return [self._immediate(admission.models())]
        target = admission.route(method, path.partition("?")[0])
        if isinstance(target, Answer):
            return [self._immediate(target)]
        self._route = target
        self._rec = RequestRecord(request_id=rid.decode(), route=target.kind, started=gw.clock())
        try:
            if not gw.accepting:
                raise NoInstance("The gateway is shutting down.", retry_after=1)
            self._tenant = admission.authorize(target, headers)
        except Unauthorized as exc:
            self._rec.reject = "auth"
            return [self._refuse(exc)]
        except GatewayError as exc:
            return [self._refuse(exc)]
        if message.request_headers.end_of_stream:
            return await self._pick(b"", end=True, streamed=False)
        mode = encoding.body_mode_problem(message)
        if mode is not None:  # the gateway would wait for this answer, the picker for the body
            _misconfigured(mode)
            return [
                self._refuse(
                    GatewayError(
                        f"The gateway in front sends request bodies as {mode}; its endpoint picker "
                        "needs FULL_DUPLEX_STREAMED (ext_proc processing_mode.request_body_mode).",
                        code="picker_body_mode",
                    )
                )
            ]
        return []

    async def _request_body(self, chunk: bytes, end: bool, *, trailers: bool = False) -> list[Any]:
        if self._route is None:
            return []
        limit = self._gateway.settings.gateway.max_body_bytes
        # Kept up to the chunk that crosses the limit, only counted after it: the intake refuses it.
        if self._over <= limit:
            self._body.append(chunk)
        self._over += len(chunk)
        if not end:
            return []
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        return await self._pick(body, end=not trailers, streamed=True)

    async def _pick(self, body: bytes, *, end: bool, streamed: bool) -> list[Any]:
        """The pick; ``streamed``: the gateway sent a body phase (empty chunks included), which in
        full-duplex mode must be handed back, or it never sees the request's end."""
        assert self._route is not None and self._rec is not None and self._tenant is not None
        try:
            picked = await self._admission.pick(
                self._route,
                self._headers,
                body,
                subset=self._subset,
                rec=self._rec,
                path=self._path,
                tenant=self._tenant,
            )
        except Refused as exc:
            return [self._refuse(exc.error, exc.headers)]
        except GatewayError as exc:
            return [self._refuse(exc)]
        except Exception:  # a bug of ours: still an error in the route's shape, and a log line
            log.exception("request %s failed inside the picker", self._rec.request_id)
            return [
                self._refuse(
                    GatewayError(f"Internal picker error (request id {self._rec.request_id}); see its log.")
                )
            ]
        self._tap = Tap(self._gateway, picked)
        answers = [encoding.pick_answer([picked.endpoint], picked.set_headers, picked.remove)]
        if streamed or picked.body:
            answers.extend(encoding.body_chunks(picked.body, end=end))
        return answers

    def _refuse(self, exc: GatewayError, extra: Sequence[tuple[bytes, bytes]] = ()) -> Any:
        """A refusal in the route's error shape (``extra``: its key's headers), accounted and
        logged once as ``serve`` does."""
        rec, route = self._rec, self._route
        assert rec is not None and route is not None
        refused(rec, exc)
        self._gateway.accounting.record(rec)
        return self._immediate(error_answer(route.errors, exc, rec.request_id.encode(), extra))

    def _immediate(self, answer: Answer) -> Any:
        self.done = True
        return encoding.immediate(answer.status, answer.headers, answer.body, "taogate")

    def close(self) -> None:
        """The stream is over: a picked request's tap ends it; one that never got its answer (its
        client left while it was read or queued) is accounted as ``serve`` accounts a hang-up."""
        if self._tap is not None:
            self._tap.close()
        elif self._rec is not None and not self.done:
            self.done = True
            self._rec.status = 499
            self._gateway.metrics.client_disconnects.inc()
            self._gateway.accounting.record(self._rec)


def _pass(message: Any, kind: str | None) -> list[Any]:
    """Hand back a response the picker did not pick for (the gateway's own answer) unchanged."""
    if kind == "response_headers":
        return [encoding.headers_answer([])]
    if kind == "response_body":
        body = message.response_body
        return [encoding.body_echo(body.body, body.end_of_stream)]
    if kind == "response_trailers":
        return [encoding.trailers_answer(response=True)]
    return []


@functools.cache
def _misconfigured(mode: str) -> None:
    """Said once per mode: every request the gateway in front sends that way is refused."""
    log.error(
        "the gateway in front sends request bodies as %s: every request with a body is refused "
        "(500) until its ext_proc processing_mode.request_body_mode is FULL_DUPLEX_STREAMED",
        mode,
    )
