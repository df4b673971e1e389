"""The gateway: one object that owns the fleet, the upstream pool, dispatch and metrics.

``handle()`` is the data path of one proxied request::

    auth → read body once → facts (model, size, long?, prefix key) → acquire a lease
         → forward verbatim → relay (bytes as they arrive) → release → learn → account

Retries happen only before the first byte went downstream, never to the instance that just
failed, within attempts and the retry budget. A client that goes away cancels the work, which
closes the upstream connection so vLLM aborts the request and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from taogate.control.discovery import Resolver, discovered_specs, system_resolver
from taogate.control.probes import Probes
from taogate.dispatch.policy import Policy, make_policy
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.tokens import PromptSize, TokenEstimator, load_exact_counter
from taogate.dispatch.types import RequestFacts
from taogate.errors import GatewayError, NoInstance
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.fleet.instance import Instance, InstanceSpec, Lease
from taogate.observe.access_log import AccessLog, RequestRecord
from taogate.observe.accounting import Accounting
from taogate.observe.dropped import SERVER_LOGGER, DroppedResponses
from taogate.observe.metrics import FleetCollector, GatewayMetrics
from taogate.proxy.auth import KeyCheck, header
from taogate.proxy.intake import (
    ClientGone,
    ClientStalled,
    Route,
    model_of,
    parse_json_object,
    read_body,
    request_facts,
    request_id,
)
from taogate.proxy.relay import usage_of_body
from taogate.proxy.retry import FailureKind, RetryBudget, backoff, classify
from taogate.proxy.stream import relay_sse
from taogate.proxy.upstream import (
    UPSTREAM_ERRORS,
    AttemptFailure,
    Upstream,
    UpstreamResponse,
    downstream_headers,
    translate,
    upstream_headers,
)
from taogate.settings import ConfigError, Settings

log = logging.getLogger("taogate.gateway")

Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Seconds a request runs before the gateway starts watching for its client to go away.
WATCH_AFTER = 0.05
Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(slots=True)
class Exchange:
    """One proxied request as it moves through the gateway."""

    route: Route
    facts: RequestFacts
    size: PromptSize
    body: bytes
    headers: list[tuple[bytes, bytes]]  # what goes upstream (the instance key is added per attempt)
    rid: bytes
    send: Send
    rec: RequestRecord
    started: bool = False  # a response has begun downstream: no more retries, no error JSON
    finished: bool = False  # the last body message is being sent: a disconnect now is not a hang-up


class Gateway:
    """Built once by ``create_app(settings)``; started and stopped by the ASGI lifespan."""

    def __init__(
        self,
        settings: Settings,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        rng: Callable[[], float] = random.random,
        settings_source: Callable[[], Settings] | None = None,
        resolver: Resolver = system_resolver,
        access_sink: Callable[[str], None] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.settings = settings
        self.clock = clock
        self._rng = rng
        self._environ = env
        self._settings_source = settings_source
        self.resolver = resolver
        self._access_sink = access_sink  # where access lines go instead of logging records (cli)
        self.discovered: list[InstanceSpec] = []  # from [discovery] dns, refreshed by the probes
        self.keys = KeyCheck(settings.api_key(env), settings.admin_key(env))
        # Learned speeds are rebuilt at most every 5 ms: at high request rates, once per response
        # would cost more than the rest of the learning (measured: benchmarks/overhead.py).
        self.speeds = SpeedEstimator(rebuild_every=0.005, clock=clock)
        self.tokens = TokenEstimator(chars_per_token=settings.prefill.chars_per_token)
        # Optional exact counts for plain text; TokenizerUnavailable names what is missing.
        self._exact = load_exact_counter(settings.prefill.tokenizer) if settings.prefill.tokenizer else None
        self.fleet = Fleet(settings, self.speeds)
        self.fleet.apply(settings, self._specs(settings))
        self.dispatcher = Dispatcher(
            self.fleet,
            self._make_policy(settings),
            queue_size=settings.dispatch.queue_size,
            queue_timeout=settings.dispatch.queue_timeout,
            clock=clock,
        )
        self.budget = RetryBudget(ratio=settings.dispatch.retry.budget_ratio, min_per_window=3, window=10.0)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.registry.register(FleetCollector(self.fleet, self.dispatcher, clock))
        self.accounting = Accounting(
            self.metrics,
            self.fleet,
            self.tokens,
            self.speeds,
            AccessLog(settings.gateway.log_format, access_sink),
            clock,
            settings.prefill.tag,
        )
        self.upstream: Upstream | None = None
        self.probes = Probes(self)
        self.accepting = True
        self._active = 0  # requests being handled (for graceful shutdown)
        self.dropped = DroppedResponses()  # hides the server's complaint about our deliberate drops
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def client(self) -> httpx.AsyncClient | None:
        """httpx over the upstream pool, for probes, scrapes and admin calls."""
        return self.upstream.client if self.upstream is not None else None

    @staticmethod
    def _make_policy(settings: Settings) -> Policy:
        d = settings.dispatch
        return make_policy(d.strategy, affinity=d.prefix_affinity, affinity_slack=d.affinity_slack)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.upstream = Upstream(self.settings.gateway)
        logging.getLogger(SERVER_LOGGER).addFilter(self.dropped)
        await self.probes.start()

    async def stop(self) -> None:
        """Stop taking work, give in-flight requests ``shutdown_timeout`` to finish, then close."""
        self.accepting = False
        self.dispatcher.fail_all(NoInstance("The gateway is shutting down.", retry_after=1))
        if self._active:
            log.info(
                "stopping: %d requests in flight get %gs to finish",
                self._active,
                self.settings.gateway.shutdown_timeout,
            )
            with suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.settings.gateway.shutdown_timeout)
        await self.probes.stop()
        if self.upstream is not None:
            await self.upstream.aclose()
            self.upstream = None
        logging.getLogger(SERVER_LOGGER).removeFilter(self.dropped)

    def reload_from_source(self) -> tuple[list[str], list[str], list[str]]:
        """Re-read the config files (SIGHUP, POST /admin/reload); ConfigError keeps the old config."""
        if self._settings_source is None:
            raise ConfigError("the gateway was not started from a config file; nothing to reload")
        return self.reload(self._settings_source())

    def reload(self, settings: Settings) -> tuple[list[str], list[str], list[str]]:
        """Apply a new validated config; in-flight requests keep their leases."""
        keys = KeyCheck(settings.api_key(self._environ), settings.admin_key(self._environ))
        old = self.settings
        # Another DNS name: its addresses come with the next resolution.
        discovered = self.discovered if settings.discovery.dns == old.discovery.dns else []
        specs = self._specs(settings, discovered)  # may raise ConfigError: before anything changes
        self.discovered = discovered
        restart_only = old.restart_only_changes(settings)
        if restart_only:
            log.warning("reload: %s take effect only after a restart", ", ".join(restart_only))
        policy_changed = old.dispatch.policy_key != settings.dispatch.policy_key
        self.keys = keys
        self.settings = settings
        changes = self.fleet.apply(settings, specs)
        self.accounting.access = AccessLog(settings.gateway.log_format, self._access_sink)
        self.accounting.long_tag = settings.prefill.tag
        if self.upstream is not None:
            self.upstream.configure(settings.gateway)
        d = settings.dispatch
        if policy_changed:  # a rebuilt policy forgets its rotation and its warm prefixes
            self.dispatcher.policy = self._make_policy(settings)
        self.dispatcher.queue_size = d.queue_size
        self.dispatcher.queue_timeout = d.queue_timeout
        self.budget.ratio = d.retry.budget_ratio
        self.probes.reconfigure()
        self.dispatcher.pump()
        added, removed, changed = changes
        for name in removed:
            self.metrics.forget_instance(name)
        log.info("config reloaded: added %s, removed %s, changed %s", added, removed, changed)
        return changes

    def _specs(self, settings: Settings, discovered: list[InstanceSpec] | None = None) -> list[InstanceSpec]:
        static = specs_from_settings(settings, self._environ)
        names = {s.name for s in static}
        found = self.discovered if discovered is None else discovered
        return static + [d for d in found if d.name not in names]

    def set_discovered(self, addresses: list[str]) -> tuple[list[str], list[str]]:
        """Install a new set of discovered addresses; returns (joined, left) instance names."""
        specs = discovered_specs(addresses, self.settings.discovery, self.settings, self._environ)
        if specs == self.discovered:
            return [], []
        self.discovered = specs
        added, removed, _ = self.fleet.apply(self.settings, self._specs(self.settings))
        for name in removed:  # pods come and go: their label sets must not pile up in /metrics
            self.metrics.forget_instance(name)
        self.dispatcher.pump()
        return added, removed

    # -- one request ----------------------------------------------------------------------------
    def facts(
        self, route: Route, payload: dict[str, Any], model: str | None
    ) -> tuple[RequestFacts, PromptSize]:
        return request_facts(
            route, payload, model, tokens=self.tokens, settings=self.settings, exact=self._exact
        )

    async def handle(self, route: Route, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Serve one proxied request end to end; every exit path is accounted and logged once."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request_id(header(headers, b"x-request-id"))
        client_tag = header(headers, b"x-request-tag")
        rec = RequestRecord(request_id=rid.decode(), route=route.kind, started=self.clock())
        ex: Exchange | None = None
        self._active += 1
        self._idle.clear()
        try:
            if not self.accepting:
                raise NoInstance("The gateway is shutting down.", retry_after=1)
            try:
                self.keys.check(header(headers, b"authorization"))
            except GatewayError:
                rec.reject = "auth"
                raise
            body = await read_body(
                receive, self.settings.gateway.max_body_bytes, header(headers, b"content-length")
            )
            payload = parse_json_object(body)
            rec.model = model_of(route, payload)
            facts, size = self.facts(route, payload, rec.model)
            rec.prompt_tokens_est = facts.prompt_tokens
            rec.long = facts.long
            tag = client_tag[:128] if client_tag else None
            if facts.long:
                long_tag = self.settings.prefill.tag.encode()
                tag = tag + b"," + long_tag if tag else long_tag
            rec.tag = tag.decode("latin-1") if tag else None
            up_headers = upstream_headers(headers, request_id=rid, tag=tag)
            ex = Exchange(route, facts, size, body, up_headers, rid, send, rec)
            await self._serve_watching_disconnect(ex, receive)
        except ClientGone as exc:
            rec.status = 499
            self.metrics.client_disconnects.inc()
            if isinstance(exc, ClientStalled):  # connected, not reading: the response stays unfinished
                rec.error = "client_stalled"
                self.dropped.expect()
                log.warning(
                    "request %s: client dropped, %s; the instance request was aborted", rid.decode(), exc
                )
        except GatewayError as exc:
            rec.status = exc.status
            rec.error = exc.code
            if rec.reject is None and exc.status in (400, 404, 405, 413, 429, 503):
                rec.reject = exc.code
            if ex is None or not ex.started:
                await self._send_error(send, exc, rid)
        except Exception:  # a bug of ours: still an OpenAI-shaped 500, a log line, nothing held
            log.exception("request %s failed inside the gateway", rid.decode())
            rec.status = 500
            rec.error = "internal_error"
            if ex is None or not ex.started:
                error = GatewayError(
                    f"Internal gateway error (request id {rid.decode()}); see the gateway log."
                )
                await self._send_error(send, error, rid)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()
            self.accounting.record(rec)

    async def _serve_watching_disconnect(self, ex: Exchange, receive: Receive) -> None:
        """Serve in this task while a small task waits for the client to go away; if it does, this
        task is cancelled, which releases the lease and closes the upstream connection (vLLM then
        aborts the request).

        The watcher starts only once the request has lasted ``WATCH_AFTER`` seconds: most requests
        a gateway sees at high rates finish sooner, and a timer is cheaper than a task (measured:
        ~10-15 µs per request). A client that left earlier is seen then, since uvicorn answers
        ``receive()`` with ``http.disconnect`` at once for a connection already gone: an abort at
        most ``WATCH_AFTER`` late, on requests that cost the instance little so far."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        watching = True
        gone = False
        listener: asyncio.Future[Any] | None = None

        def on_message(fut: asyncio.Future[Any]) -> None:
            nonlocal gone
            # uvicorn answers receive() with http.disconnect once the response is complete, too.
            if watching and not ex.finished and not fut.cancelled() and fut.exception() is None:
                gone = True
                task.cancel()

        def watch() -> None:
            nonlocal listener
            if watching:
                listener = asyncio.ensure_future(receive())
                listener.add_done_callback(on_message)

        timer = loop.call_later(WATCH_AFTER, watch)
        try:
            await self._serve(ex)
        except asyncio.CancelledError:
            if gone and task.uncancel() == 0:
                raise ClientGone from None
            raise
        finally:
            watching = False
            timer.cancel()
            if listener is not None:
                listener.cancel()

    async def _serve(self, ex: Exchange) -> None:
        """Attempts: acquire a lease, forward, and fail over before the first byte went downstream."""
        retry = self.settings.dispatch.retry
        exclude: frozenset[str] = frozenset()
        self.budget.record_request(self.clock())
        attempt = 0
        while True:
            attempt += 1
            ready = self.dispatcher.try_acquire(ex.facts, exclude)
            if ready is not None:
                (lease, pick), waited = ready, 0.0
            else:
                lease, pick, waited = await self.dispatcher.wait_for_slot(ex.facts, exclude)
            rec = ex.rec
            rec.queue_wait += waited
            if waited:
                self.metrics.queue_wait.observe(waited)
            rec.instance = lease.instance.name
            if pick.channel_fallback:
                rec.channel_fallback = True
            self.metrics.child(self.metrics.decisions, self.settings.dispatch.strategy, pick.reason).inc()
            tried = exclude | {lease.instance.name}

            def may_retry(tried: frozenset[str] = tried, attempt: int = attempt) -> bool:
                # Only when another instance could really take it (model, channel, health), or the
                # instance's own answer would be swapped for a gateway 503.
                now = self.clock()
                return (
                    attempt < retry.max_attempts
                    and self.dispatcher.could_send(ex.facts, tried)
                    and self.budget.try_spend(now)
                )

            try:
                await self._attempt(ex, lease, may_retry)
                return
            except AttemptFailure as failure:
                rec.retries += 1
                self.metrics.retries.labels(failure.reason).inc()
                log.info(
                    "request %s: %s on %s; retrying elsewhere",
                    rec.request_id,
                    failure.detail,
                    failure.instance,
                )
                exclude = tried
            finally:
                lease.release()
            await asyncio.sleep(backoff(attempt, retry.backoff_base, retry.backoff_max, self._rng()))

    def _instance_failed(self, inst: Instance) -> None:
        t = inst.breaker.record_failure(self.clock())
        if t is not None:
            self.probes.breaker_changed(inst, t)

    def _judge(
        self,
        ex: Exchange,
        inst: Instance,
        kind: FailureKind,
        detail: str,
        *,
        may_retry: Callable[[], bool],
        status: int | None = None,
    ) -> None:
        """Judge a failed attempt. Raises AttemptFailure when a retry elsewhere is granted; else,
        for a transport failure, the gateway's own error; for an HTTP status, returns (the
        instance's answer is relayed as it is)."""
        verdict = classify(kind, status=status)
        if verdict.instance_fault:
            self._instance_failed(inst)
        ex.rec.error = verdict.reason
        failure = AttemptFailure(verdict.reason, inst.name, detail)
        if verdict.retry and may_retry():
            raise failure
        if verdict.retry:
            self.metrics.retries_denied.labels(verdict.reason).inc()
        if status is None:
            raise failure.as_error()

    async def _attempt(self, ex: Exchange, lease: Lease, may_retry: Callable[[], bool]) -> None:
        inst = lease.instance
        upstream = self.upstream
        assert upstream is not None, "Gateway.start() was not awaited"
        headers = ex.headers
        if inst.spec.api_key:
            headers = [*headers, (b"authorization", b"Bearer " + inst.spec.api_key.encode())]
        sent_at = self.clock()
        try:
            response = await upstream.send(inst.spec.url, ex.route.upstream_path, headers, ex.body)
        except UPSTREAM_ERRORS as exc:
            self._judge(ex, inst, *translate(exc), may_retry=may_retry)
            raise AssertionError("unreachable: _judge raises for transport failures") from exc
        try:
            status = response.status_code
            if status >= 400:
                self._judge(
                    ex, inst, FailureKind.STATUS, f"HTTP {status}", may_retry=may_retry, status=status
                )
            complete = True
            if response.header("content-type").startswith("text/event-stream"):
                complete = await self._relay_stream(ex, lease, response, sent_at)
            else:
                await self._relay_whole(ex, lease, response, sent_at, may_retry)
            if complete:
                ex.rec.status = status
            if complete and status < 500:
                t = inst.breaker.record_success(self.clock())
                if t is not None:
                    self.probes.breaker_changed(inst, t)
                if status == 200 and ex.route.generates:
                    self.accounting.learn(ex.rec, ex.facts, ex.size, lease)
        finally:
            response.close()

    async def _relay_whole(
        self,
        ex: Exchange,
        lease: Lease,
        response: UpstreamResponse,
        sent_at: float,
        may_retry: Callable[[], bool],
    ) -> None:
        """Non-stream answers are small JSON: read them whole, so a failure mid-body is still retryable."""
        inst = lease.instance
        try:
            data = await response.aread()
        except UPSTREAM_ERRORS as exc:
            self._judge(ex, inst, *translate(exc), may_retry=may_retry)
            raise AssertionError("unreachable: _judge raises for transport failures") from exc
        lease.first_token()
        ex.rec.ttfb = self.clock() - sent_at
        headers = downstream_headers(response.raw_headers, request_id=ex.rid, instance=inst.name)
        headers.append((b"content-length", str(len(data)).encode()))
        ex.started = True
        await ex.send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        ex.finished = True
        await ex.send({"type": "http.response.body", "body": data, "more_body": False})
        if response.status_code == 200:
            ex.rec.usage = usage_of_body(data)

    async def _relay_stream(
        self, ex: Exchange, lease: Lease, response: UpstreamResponse, sent_at: float
    ) -> bool:
        """Relay the SSE stream; a failure after the 200 blames the instance and is accounted as the
        502-class failure it is. Returns whether the stream completed."""
        inst = lease.instance
        ex.started = True
        headers = downstream_headers(response.raw_headers, request_id=ex.rid, instance=inst.name)
        await ex.send({"type": "http.response.start", "status": response.status_code, "headers": headers})

        def first_chunk() -> None:
            lease.first_token()
            ex.rec.ttfb = self.clock() - sent_at

        def last_message() -> None:
            ex.finished = True

        end = await relay_sse(
            response,
            ex.send,
            instance=inst.name,
            idle=self.settings.gateway.stream_idle_timeout,
            stall=self.settings.gateway.client_stall_timeout,
            on_first_chunk=first_chunk,
            on_last_message=last_message,
        )
        ex.rec.usage = end.usage
        if end.error is not None:
            ex.rec.error = end.error
            ex.rec.status = 502
            self.metrics.child(self.metrics.stream_errors, inst.name, end.error).inc()
            self._instance_failed(inst)
        return end.error is None

    @staticmethod
    async def _send_error(send: Send, exc: GatewayError, rid: bytes) -> None:
        headers = [*exc.headers(), (b"x-request-id", rid)]
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": exc.body(), "more_body": False})
