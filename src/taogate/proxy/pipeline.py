"""The request pipeline: one proxied request end to end.

::

    auth (whose key) → intake (body once, facts) → the key's limits → lease on an instance
         → forward (the body's bytes, fields spliced in only where needed) → relay (bytes as they
         arrive) → learn → release → account

Retries happen only before the first byte went downstream, never to the instance that just
failed, within attempts and the retry budget. A client that goes away cancels the work, which
closes the upstream connection so vLLM aborts the request and frees its slot. Every exit path is
accounted and logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from starlette.types import Receive, Send

from taogate import h1
from taogate.errors import BadRequest, ErrorShape, GatewayError, NoInstance, UpstreamError
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.events import FleetEvents
from taogate.fleet.instance import Instance
from taogate.fleet.lease import Lease
from taogate.fleet.load_report import RESPONSE_HEADER as LOAD_REPORT_RESPONSE
from taogate.observe.accounting import Accounting
from taogate.observe.dropped import DroppedResponses
from taogate.observe.metrics import GatewayMetrics
from taogate.proxy.auth import KeyCheck, header
from taogate.proxy.disconnect import DisconnectWatcher
from taogate.proxy.exchange import Exchange
from taogate.proxy.forward import plan
from taogate.proxy.intake import ClientGone, ClientStalled, Incoming, Intake, request_id
from taogate.proxy.multipart import ClientLeft
from taogate.proxy.relay import relay_sse
from taogate.proxy.responses import ResponseIds
from taogate.proxy.retry import AttemptFailure, Failure, Judgement, Next, RetryBudget, backoff, judge
from taogate.proxy.routes import Route
from taogate.proxy.upstream import (
    UPSTREAM_ERRORS,
    Upstream,
    UpstreamResponse,
    failure_of,
    status_failure,
    upstream_headers,
)
from taogate.proxy.usage import usage_of_body
from taogate.request_record import RequestRecord
from taogate.settings import Settings
from taogate.tenancy.limiter import Admission, Limiter

__all__ = ["Pipeline"]

log = logging.getLogger("taogate.gateway")

#: Seconds a request runs (up to twice that) before the gateway watches for its client to go away.
WATCH_AFTER = 0.05


class InFlight:
    """The requests being served, whichever config's pipeline serves them (a reload builds a new
    pipeline and carries this over), and whether new ones are still taken."""

    __slots__ = ("accepting", "count", "idle")

    def __init__(self) -> None:
        self.accepting = True
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()


class Pipeline:
    """Serves proxied requests under one config (a reload builds another: the gateway's ``Parts``);
    ``drain`` ends the service. ``responses`` and ``inflight`` are carried from config to config.
    """

    def __init__(
        self,
        settings: Settings,
        keys: KeyCheck,
        *,
        intake: Intake,
        dispatcher: Dispatcher,
        limiter: Limiter,
        upstream: Upstream,
        accounting: Accounting,
        metrics: GatewayMetrics,
        budget: RetryBudget,
        events: FleetEvents,
        dropped: DroppedResponses,
        clock: Callable[[], float],
        rng: Callable[[], float],
        responses: ResponseIds,
        inflight: InFlight,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.intake = intake
        self.dispatcher = dispatcher
        self.limiter = limiter
        self.upstream = upstream
        self.accounting = accounting
        self.metrics = metrics
        self.budget = budget
        self.events = events
        self.dropped = dropped
        self.clock = clock
        self._rng = rng
        self.responses = responses
        self.inflight = inflight
        self._prefix = settings.gateway.prefix  # a property that parses base_url: read once
        self._watcher = DisconnectWatcher(WATCH_AFTER)
        self._decided: dict[str, Any] = {}  # pick reason → its decisions counter, this config's strategy

    @property
    def in_flight(self) -> int:
        """Requests being handled now, queued ones included (under any config)."""
        return self.inflight.count

    @property
    def accepting(self) -> bool:
        return self.inflight.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        """False: new requests are refused (503), under whichever config (a stop, the picker's)."""
        self.inflight.accepting = value

    async def drain(self, grace: float) -> None:
        """Stop taking work; give the requests in flight ``grace`` seconds to finish."""
        inflight = self.inflight
        inflight.accepting = False
        self.dispatcher.fail_all(NoInstance("The gateway is shutting down.", retry_after=1))
        if inflight.count:
            log.info("stopping: %d requests in flight get %gs to finish", inflight.count, grace)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(inflight.idle.wait(), grace)

    async def handle(self, route: Route, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Serve one proxied request end to end; every exit path is accounted and logged once."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request_id(header(headers, b"x-request-id"))
        rec = RequestRecord(request_id=rid.decode(), route=route.kind, started=self.clock())
        ex: Exchange | None = None
        admission: Admission | None = None  # the client key's: held until the very end
        incoming: Incoming | None = None  # read: an error before its body is all in closes the connection
        inflight = self.inflight
        inflight.count += 1
        inflight.idle.clear()
        try:
            if not inflight.accepting:
                raise NoInstance("The gateway is shutting down.", retry_after=1)
            tenant = self.keys.check_request(headers, either=route.anthropic)
            incoming = await self.intake.read(route, headers, receive, tenant.max_priority)
            facts = incoming.facts
            rec.model = incoming.model
            rec.prompt_tokens_est = facts.prompt_tokens
            rec.long = facts.long
            rec.priority = facts.priority or None
            rec.tag = incoming.tag.decode("latin-1") if incoming.tag else None
            admission, send = await self.limiter.admit(
                tenant, facts, incoming.model, rec, send, metered=route.metered
            )
            up_headers = upstream_headers(
                headers, request_id=rid, tag=incoming.tag, client=scope.get("client")
            )
            ids, fleet = self.responses, self.dispatcher.fleet
            forward, exclude = plan(
                route, scope, self._prefix, up_headers, incoming, ids=ids, fleet=fleet, ask_usage=True
            )
            ex = Exchange(route, facts, incoming.size, forward, rid, send, rec, exclude)
            watch = self._watcher.watch(ex, receive)
            try:
                await self._serve(ex)
            except asyncio.CancelledError:
                if watch.left():
                    raise ClientGone from None
                raise
            finally:
                watch.stop()
        except (ClientGone, ClientLeft) as exc:
            rec.status = 499
            self.metrics.client_disconnects.inc()
            if isinstance(exc, ClientStalled):  # connected, not reading: the response stays unfinished
                rec.error = "client_stalled"
                self.dropped.expect()
                log.warning(
                    "request %s: client dropped, %s; the instance request was aborted", rid.decode(), exc
                )
        except GatewayError as refused:
            rec.status = refused.status
            rec.error = refused.code
            if rec.reject is None and refused.status in (400, 401, 404, 405, 408, 413, 415, 429, 503):
                rec.reject = "auth" if refused.status == 401 else refused.code
            if ex is None or not ex.started:
                await _send_error(send, route.errors, refused, rid, close=_unread(incoming))
        except Exception:  # a bug of ours: still an OpenAI-shaped 500, a log line, nothing held
            log.exception("request %s failed inside the gateway", rid.decode())
            rec.status = 500
            rec.error = "internal_error"
            if ex is None or not ex.started:
                error = GatewayError(
                    f"Internal gateway error (request id {rid.decode()}); see the gateway log."
                )
                await _send_error(send, route.errors, error, rid, close=_unread(incoming))
        finally:
            inflight.count -= 1
            if not inflight.count:
                inflight.idle.set()
            self.limiter.release(admission, rec)
            self.accounting.record(rec)

    async def _serve(self, ex: Exchange) -> None:
        """Attempts: acquire a lease, forward, and fail over before the first byte went downstream."""
        retry = self.settings.dispatch.retry
        exclude = ex.exclude
        self.budget.record_request(self.clock())
        attempt = 0
        while True:
            attempt += 1
            rec = ex.rec
            ready = self.dispatcher.try_acquire(ex.facts, exclude)
            if ready is not None:
                lease, pick = ready
            else:
                waited = partial(self.accounting.waited, rec)
                lease, pick = await self.dispatcher.wait_for_slot(ex.facts, exclude, waited)
            rec.instance, rec.error = lease.instance.name, None  # this attempt's, not the last one's
            rec.channel_fallback = True if pick.channel_fallback else None
            decided = self._decided.get(pick.reason)
            if decided is None:
                m = self.metrics
                decided = self._decided[pick.reason] = m.child(
                    m.decisions, self.settings.dispatch.strategy, pick.reason
                )
            decided.inc()
            ex.attempt, ex.tried = attempt, exclude | {lease.instance.name}
            try:
                await self._attempt(ex, lease)
                return
            except AttemptFailure as failure:
                rec.retries += 1
                self.metrics.retries.labels(failure.instance, failure.reason).inc()
                self.accounting.attempt_failed(lease.instance, failure.blame)
                rec.instance = None  # what ends the request (a refusal, say) is not this instance's
                log.info(
                    "request %s: %s on %s; retrying elsewhere",
                    rec.request_id,
                    failure.detail,
                    failure.instance,
                )
                exclude = ex.tried
            finally:
                lease.release()
            await asyncio.sleep(backoff(attempt, retry.backoff_base, retry.backoff_max, self._rng()))

    def _room(self, ex: Exchange) -> bool:
        """Whether another attempt may follow this one: attempts left, the body can be sent again,
        another instance could really take it (model, channel, health), the budget has room."""
        return (
            ex.attempt < self.settings.dispatch.retry.max_attempts
            and ex.forward.replayable
            and self.dispatcher.could_send(ex.facts, ex.tried)
            and self.budget.has_room(self.clock())
        )

    def _judged(self, ex: Exchange, inst: Instance, failure: Failure) -> Judgement:
        """``retry.judge``'s verdict on a failed attempt, with its effects: the instance blamed,
        the request's error accounted, a retry's budget spent."""
        verdict = judge(failure, inst.name, self._room(ex))
        if verdict.blame:
            self.events.request_failed(inst)
        ex.rec.error = verdict.reason
        if verdict.denied:
            self.metrics.retries_denied.labels(inst.name, verdict.reason).inc()
        if verdict.next is Next.RETRY:
            self.budget.try_spend(self.clock())
        return verdict

    async def _attempt(self, ex: Exchange, lease: Lease) -> None:
        """One attempt, in steps that each return or raise: the request sent (its answer's head),
        its status judged, its body relayed."""
        inst = lease.instance
        forward = ex.forward
        headers, body = forward.to(inst.spec)
        sent_at = self.clock()
        try:
            response = await self.upstream.send(inst.spec.url, forward.path, headers, body, forward.method)
        except UPSTREAM_ERRORS as exc:
            raise self._judged(ex, inst, failure_of(exc)).exception() from None
        except h1.InvalidRequest as invalid:
            raise BadRequest(f"The request cannot be forwarded: {invalid}.") from None
        try:
            status = response.status_code
            if status >= 400:
                verdict = self._judged(ex, inst, status_failure(status))
                if verdict.next is Next.RETRY:
                    raise verdict.exception()  # else the instance's answer goes as it is
            complete = True
            if response.header("content-type").startswith("text/event-stream"):
                complete = await self._relay_stream(ex, lease, response, sent_at)
            else:
                await self._relay_whole(ex, lease, response, sent_at)
            if complete:
                ex.rec.status = status
            if complete and status < 500:
                self.events.request_succeeded(inst)
                if status == 200:
                    forward.succeeded(inst.name)
                    if ex.route.generates:
                        self.accounting.learn(ex.rec, ex.facts, ex.size, lease)
        finally:
            response.close()

    async def _relay_whole(
        self, ex: Exchange, lease: Lease, response: UpstreamResponse, sent_at: float
    ) -> None:
        """Non-stream answers are read whole, so a failure mid-body is still retryable: within
        ``max_response_bytes`` and ``request_timeout``. An answer over the size is refused without
        blaming the instance (an operator's limit, which the next instance would meet too)."""
        inst = lease.instance
        cfg = self.settings.gateway
        try:
            data = await response.aread(cfg.max_response_bytes, cfg.request_timeout)
        except h1.ResponseTooLarge as big:
            log.warning(
                "request %s: instance %s answered more than %d bytes", ex.rec.request_id, inst.name, big.limit
            )
            raise UpstreamError(
                f"Instance {inst.name} answered more than {big.limit} bytes ([gateway] max_response_bytes).",
                code="upstream_response_too_large",
            ) from None
        except UPSTREAM_ERRORS as exc:
            raise self._judged(ex, inst, failure_of(exc)).exception() from None
        lease.first_token()
        now = self.clock()
        inst.record_load_report(response.header(LOAD_REPORT_RESPONSE), now)  # load-report hook
        ex.rec.ttfb = now - sent_at
        headers = ex.forward.answer_headers(response.raw_headers, ex.rid, inst.name, lease.receipt)
        headers.append((b"content-length", str(len(data)).encode()))
        ex.started = True
        send = ex.send  # the answer whole, in two messages (no coroutine more around them)
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        ex.finished = True  # the last body message is being sent
        await send({"type": "http.response.body", "body": data, "more_body": False})
        if response.status_code == 200:
            rec = ex.rec
            rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = ex.route.usage(usage_of_body(data))

    async def _relay_stream(
        self, ex: Exchange, lease: Lease, response: UpstreamResponse, sent_at: float
    ) -> bool:
        """Relay the SSE stream; a failure after the 200 blames the instance and is accounted as the
        502-class failure it is. Returns whether the stream completed."""
        inst = lease.instance
        ex.started = ex.rec.stream = True
        headers = ex.forward.answer_headers(response.raw_headers, ex.rid, inst.name, lease.receipt)
        await ex.send({"type": "http.response.start", "status": response.status_code, "headers": headers})

        def first_chunk() -> None:
            lease.first_token()
            ex.rec.ttfb = self.clock() - sent_at

        cfg = self.settings.gateway
        end = await relay_sse(
            response,
            ex.send,
            instance=inst.name,
            idle=cfg.stream_idle_timeout,
            stall=cfg.client_stall_timeout,
            limit=cfg.stream_timeout,
            errors=ex.route.errors,
            on_first_chunk=first_chunk,
            on_last_message=ex.last_message,
            hide_usage=ex.forward.hide_usage,
        )
        rec = ex.rec
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = ex.route.usage(end.usage)
        if end.error is not None:
            ex.rec.error = end.error
            ex.rec.status = 502
            self.metrics.child(self.metrics.stream_errors, inst.name, end.error).inc()
            if end.error != "stream_timeout":  # a long stream is the gateway's limit, not a fault
                self.events.request_failed(inst)
        return end.error is None


def _unread(incoming: Incoming | None) -> bool:
    """The client's body is not all in (not read, or an upload still arriving): an error answered
    now ends the connection, whose unread rest cannot carry the next request."""
    return incoming is None or (incoming.upload is not None and not incoming.upload.done)


async def _send_error(send: Send, shape: ErrorShape, exc: GatewayError, rid: bytes, *, close: bool) -> None:
    """The error, whole; ``close``: the body was not read, so the connection is not reused (the
    listener still reads and discards it for a while, so the client sees the answer)."""
    body = shape.body(exc)
    headers = [*shape.headers(exc), (b"x-request-id", rid), (b"content-length", str(len(body)).encode())]
    headers += [(name, rid) for name in shape.request_id_aliases]
    if close and not exc.closes:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
