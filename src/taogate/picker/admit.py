"""One request's way to its pick: route, key, body facts, plan and lease, as ``serve`` does it.

Every step is the proxy's own: ``KeyCheck`` for the client's key, ``Intake`` for the body's facts
(model, stream flag, token estimate, prefix key, priority, tag; first ``Objectives`` puts the
class of a named InferenceObjective in place of the request's own, and ``rewritten_model`` the model
the gateway names in place of the body's), ``Limiter`` for its key's limits,
``plan`` and ``Forward.to`` for what the instance is told (its own key, its priority, a Responses
id), ``Dispatcher`` for the pick and its lease. What differs is only the output: header changes and
a body for the gateway in front to send, instead of a request of our own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import unquote

import orjson

from taogate.app import unknown_path_message
from taogate.dispatch.tokens import PromptSize
from taogate.dispatch.types import RequestFacts
from taogate.errors import OPENAI_ERRORS, GatewayError, MethodNotAllowed, NoInstance, NotFound
from taogate.fleet.lease import Lease
from taogate.gateway import Gateway
from taogate.picker.encoding import Headers
from taogate.picker.hints import endpoint_of, excluded_by_subset, origin_of
from taogate.picker.names import FAIRNESS_ID, first_header
from taogate.picker.objective import Objectives
from taogate.picker.rewrite import rewritten_model
from taogate.proxy.auth import header
from taogate.proxy.forward import Forward, plan
from taogate.proxy.intake import Incoming
from taogate.proxy.routes import RESPONSE_ITEM, RESPONSE_ITEM_PREFIX, Route
from taogate.proxy.upstream import HOP_BY_HOP, upstream_headers
from taogate.request_record import RequestRecord
from taogate.tenancy import limiter
from taogate.tenancy.keys import Tenant

__all__ = ["Admission", "Answer", "Picked", "Refused", "header_changes", "refused"]

#: A flow's name for fair share (``names.FAIRNESS_ID``, set by the gateway in front, read only where
#: that gateway authenticates: a client's own claim is not trusted): visible ASCII, as header values
#: usually are.
_FLOW = re.compile(rb"[\x21-\x7e]{1,128}")


def header_changes(before: Headers, after: Headers) -> tuple[Headers, list[bytes]]:
    """(headers to set, names to remove) that turn ``before`` into ``after``; pseudo-headers and
    framing stay the gateway's own (it frames the body it sends)."""
    names = {k for k, _ in after}
    have = set(before)
    remove = sorted(
        {k for k, _ in before if k not in names and k not in HOP_BY_HOP and not k.startswith(b":")}
    )
    return [(k, v) for k, v in after if (k, v) not in have], remove


@dataclass(slots=True)
class Picked:
    """A request on its way to an instance: what the tap needs to learn from its response."""

    route: Route
    rec: RequestRecord
    facts: RequestFacts
    size: PromptSize
    forward: Forward
    lease: Lease
    rid: bytes
    endpoint: str  # host:port of the lease's instance (``hints.endpoint_of``: never its URL's credentials)
    set_headers: Headers
    remove: list[bytes]
    body: bytes  # what goes upstream
    sent_at: float
    admitted: limiter.Admission  # its key's: held until the response ends


class Refused(Exception):
    """A refusal after the key was admitted: ``error``, answered with the key's ``headers``
    (``x-ratelimit-*``), as ``serve`` answers it."""

    def __init__(self, error: GatewayError, headers: Headers) -> None:
        super().__init__(error.message)
        self.error, self.headers = error, headers


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer the picker gives itself (an error, or the model list): status, headers, body."""

    status: int
    headers: Headers
    body: bytes


class Admission:
    """Routes, checks and picks for one gateway; ``check_key`` off where the gateway authenticates."""

    def __init__(self, gateway: Gateway, routes: Mapping[str, Route], *, check_key: bool) -> None:
        self.gateway = gateway
        self._routes = dict(routes)
        self.check_key = check_key
        self.objectives = Objectives()
        prefix = gateway.settings.gateway.prefix
        self._items = (RESPONSE_ITEM_PREFIX, prefix + RESPONSE_ITEM_PREFIX)
        self._models = {"/v1/models", prefix + "/v1/models"}

    def route(self, method: str, path: str) -> Route | Answer:
        """The proxied route of a request, or the picker's own answer: a 404 or a 405."""
        route = self._routes.get(path)
        if route is None and path.startswith(self._items):
            route = RESPONSE_ITEM
        if route is None:
            g = self.gateway.settings.gateway
            return error_answer(OPENAI_ERRORS, NotFound(unknown_path_message(path, g.prefix, g.base_url)))
        if method not in route.methods:
            allowed = ", ".join(sorted(route.methods))
            return error_answer(
                route.errors, MethodNotAllowed(f"{method} is not allowed on {path}: use {allowed}.")
            )
        return route

    def is_models(self, method: str, path: str) -> bool:
        return method == "GET" and path in self._models

    def models(self) -> Answer:
        """``GET /v1/models`` as ``serve`` answers it: the fleet's model cards."""
        cards: dict[str, dict[str, Any]] = {}
        for inst in self.gateway.fleet:
            for mid, card in inst.model_cards.items():
                cards.setdefault(mid, card)
        body = orjson.dumps({"object": "list", "data": [cards[k] for k in sorted(cards)]})
        return Answer(200, [(b"content-type", b"application/json")], body)

    def authorize(self, route: Route | None, headers: Headers) -> Tenant:
        """Whose key, as ``serve`` checks it (raises ``Unauthorized``); without the check, the
        unified key's: the gateway in front authenticated the client."""
        keys = self.gateway.keys
        if self.check_key:
            return keys.check_request(headers, either=route is None or route.anthropic)
        return keys.table.unified

    def flow(self, headers: Headers) -> str | None:
        """The fair share's name for the request where the gateway in front authenticates and
        names its flow (``names.FAIRNESS_ID``); None otherwise, or for a malformed name."""
        if self.check_key:
            return None
        found = first_header(headers, FAIRNESS_ID)
        if found is None or _FLOW.fullmatch(found[1]) is None:
            return None
        return "flow:" + found[1].decode("ascii")  # never a key's name, which has no colon

    async def pick(
        self,
        route: Route,
        headers: Headers,
        body: bytes,
        *,
        subset: frozenset[str] | None,
        rec: RequestRecord,
        path: str,
        tenant: Tenant,
    ) -> Picked:
        """Read the request's facts, admit it against its key's limits and take a lease on the
        instance dispatch picks (within the subset, if the gateway set one); GatewayError for every
        refusal."""
        gw = self.gateway
        plain = [(k, v) for k, v in headers if not k.startswith(b":")]
        classed, sheddable = self.objectives.read(plain, gw.settings.picker.objectives)
        rewrite = rewritten_model(plain) if route.body == "json" else None
        incoming = await gw.pipeline.intake.read(
            route, classed, _once(body), tenant.max_priority, rewrite=rewrite
        )
        facts = incoming.facts
        rec.model = incoming.model
        rec.prompt_tokens_est = facts.prompt_tokens
        rec.long = facts.long
        rec.priority = facts.priority or None
        rec.tag = incoming.tag.decode("latin-1") if incoming.tag else None
        rid = rec.request_id.encode()
        admitted = await gw.limiter.enter(
            tenant, facts, incoming.model, rec, self.flow(plain), metered=route.metered
        )
        try:
            forward, exclude = self._plan(
                route, plain, incoming, path=path, method=route_method(headers), rid=rid, subset=subset
            )
            lease = await self._lease(facts, exclude, rec, hinted=subset is not None, sheddable=sheddable)
        except BaseException as exc:
            if not isinstance(exc, GatewayError):
                gw.limiter.release(admitted, rec)
                raise
            refused(rec, exc)  # before the release, which counts the refusal against the key
            gw.limiter.release(admitted, rec)
            if admitted.headers:
                raise Refused(exc, admitted.headers) from exc
            raise
        try:
            spec = lease.instance.spec
            up_headers, up_body = forward.to(spec)
            origin = origin_of(spec.url)
            basic = origin.basic_auth  # the URL's credentials, sent as h1 sends them under serve
            if basic is not None and not any(k == b"authorization" for k, _ in up_headers):
                up_headers = [*up_headers, (b"authorization", basic)]
            set_headers, remove = header_changes(plain, up_headers)
            target = origin.path + forward.path  # as serve sends it: less the gateway's prefix
            if target != path.encode("latin-1"):
                set_headers.append((b":path", target))
            sent = up_body if isinstance(up_body, bytes) else body  # a multipart upload goes as it came
            now = gw.clock()
        except BaseException:
            lease.release()
            gw.limiter.release(admitted, rec)
            raise
        return Picked(
            route,
            rec,
            facts,
            incoming.size,
            forward,
            lease,
            rid,
            endpoint_of(spec.url),
            set_headers,
            remove,
            sent,
            now,
            admitted,
        )

    def _plan(
        self,
        route: Route,
        plain: Headers,
        incoming: Incoming,
        *,
        path: str,
        method: str,
        rid: bytes,
        subset: frozenset[str] | None,
    ) -> tuple[Forward, frozenset[str]]:
        """What the instance is told, and the instances the request may not go to."""
        gw = self.gateway
        up = upstream_headers(plain, request_id=rid, tag=incoming.tag)
        path_only, _, query = path.partition("?")
        scope = {
            "path": unquote(path_only),
            "raw_path": path_only.encode("latin-1"),  # Envoy's :path, percent-encoded as sent
            "query_string": query.encode(),
            "method": method,
            "headers": plain,
        }
        fleet = gw.dispatcher.fleet
        forward, exclude = plan(
            route, scope, gw.settings.gateway.prefix, up, incoming, ids=gw.pipeline.responses, fleet=fleet
        )
        if subset is not None:
            exclude |= excluded_by_subset(fleet, subset)
            if all(i.name in exclude for i in fleet):
                raise NoInstance(
                    "No instance of the gateway's subset hint can take this request.", retry_after=1
                )
        return forward, exclude

    async def _lease(
        self,
        facts: RequestFacts,
        exclude: frozenset[str],
        rec: RequestRecord,
        *,
        hinted: bool,
        sheddable: bool,
    ) -> Lease:
        """A lease from dispatch, waiting in the gateway queue if need be; a sheddable request (its
        objective's priority is negative) never waits: every instance at its cap, it gets a 429."""
        gw = self.gateway
        dispatcher, metrics = gw.dispatcher, gw.metrics
        try:
            ready = dispatcher.try_acquire(facts, exclude)
            if ready is not None:
                lease, pick = ready
            else:
                waited = partial(gw.accounting.waited, rec)
                lease, pick = await dispatcher.wait_for_slot(facts, exclude, waited, shed=sheddable)
        except NotFound as exc:
            if hinted:  # the subset serves no such model: the protocol's answer is 503
                raise NoInstance(
                    f"No instance of the gateway's subset hint can take this request ({exc.message})"
                ) from None
            raise
        rec.instance = lease.instance.name
        if pick.channel_fallback:
            rec.channel_fallback = True
        metrics.child(metrics.decisions, gw.settings.dispatch.strategy, pick.reason).inc()
        return lease


def refused(rec: RequestRecord, exc: GatewayError) -> None:
    """A refusal's marks on the request's record, as ``serve`` accounts them."""
    rec.status = exc.status
    rec.error = exc.code
    if rec.reject is None and exc.status in (400, 404, 405, 408, 413, 415, 429, 503):
        rec.reject = exc.code


def route_method(headers: Headers) -> str:
    method = header(headers, b":method")
    return method.decode("latin-1") if method else "POST"


def error_answer(
    shape: Any, exc: GatewayError, rid: bytes | None = None, extra: Sequence[tuple[bytes, bytes]] = ()
) -> Answer:
    """A gateway error in its route's shape (OpenAI's or Anthropic's), as ``serve`` renders it;
    ``extra``: its key's headers."""
    headers = [(k, v) for k, v in shape.headers(exc) if k not in HOP_BY_HOP]
    if rid is not None:
        headers.append((b"x-request-id", rid))
        headers += [(name, rid) for name in shape.request_id_aliases]
    headers.extend(extra)
    return Answer(exc.status, headers, shape.body(exc))


def _once(body: bytes) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands over a body already read whole (the intake reads from one)."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive
