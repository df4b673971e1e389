"""Admission against a key's limits, answered as OpenAI answers: model allow-list, concurrency,
requests and tokens per window, and the ``x-ratelimit-*`` headers of every response of a limited key.

A request reserves one request and its estimated tokens (prompt + ``max_tokens``) when admitted and
holds one of its key's concurrency slots until ``release``, exactly once, on every exit path (with
a shared store, also a lease there that its replica renews: ``store``); its tokens are settled from
usage then. When the shared store fails, ``on_store_error`` says what happens (admit, or 503); a
failed store is tried again at most once a second, every call bounded by ``store_timeout``, so no
request waits on a store longer than that.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any, overload

from redis.exceptions import RedisError
from starlette.types import Send

from taogate.dispatch.types import RequestFacts
from taogate.errors import BadRequest, GatewayError, NoInstance, NotFound
from taogate.key_settings import LimitsSettings
from taogate.request_record import RequestRecord
from taogate.tenancy.answers import RateLimited, rate_headers, refusal
from taogate.tenancy.fairshare import FairShare
from taogate.tenancy.keys import KeyTable, Tenant
from taogate.tenancy.store import LocalStore, Store
from taogate.tenancy.window import Counts

__all__ = ["Admission", "KeyStats", "Limiter", "RateLimited"]

log = logging.getLogger("taogate.limits")

#: Seconds a failed store is left alone before one request tries it again.
STORE_RETRY = 1.0
STORE_ERRORS = (RedisError, OSError, TimeoutError)


@dataclass(slots=True)
class KeyStats:
    """One key's tallies on this replica (metrics, /admin/keys)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    last: Counts | None = None  # its counters after its latest check


@dataclass(init=False, slots=True)
class Admission:
    """One admitted request: what it reserved, and the headers its response carries."""

    tenant: Tenant
    stats: KeyStats
    headers: list[tuple[bytes, bytes]]
    reserved: int = 0
    bucket: int | None = None  # where its tokens were reserved (None: nowhere)
    released: bool = False
    share: str = ""  # the fair-share counter it is charged to: its key's, or a flow's
    lease: str = ""  # its lease of the key's max_concurrency in the shared store ("": none)

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        tenant: Tenant,
        stats: KeyStats,
        headers: list[tuple[bytes, bytes]],
        reserved: int = 0,
        bucket: int | None = None,
        released: bool = False,
        share: str = "",
        lease: str = "",
    ) -> None:
        self.tenant = tenant
        self.stats = stats
        self.headers = headers
        self.reserved = reserved
        self.bucket = bucket
        self.released = released
        self.share = share
        self.lease = lease


def _busy(tenant: Tenant, counts: Counts | None, window: float) -> RateLimited:
    """The concurrency refusal, with the key's rate-limit headers as its counters last read."""
    return RateLimited(
        f"Too many requests in flight for key {tenant.name}: Limit {tenant.max_concurrency} at once. "
        "Please try again when one has finished.",
        "requests",
        1.0,
        rate_headers(tenant, counts, window) if counts is not None else [],
    )


def _admitted(admission: Admission) -> Admission:
    """An admission counted: it holds one of its key's concurrency slots until ``finish``."""
    stats = admission.stats
    stats.in_flight += 1
    stats.requests += 1
    return admission


class Limiter:
    """Admits requests against their key's limits; one per gateway, ``configure``d on reload."""

    def __init__(
        self,
        table: KeyTable,
        limits: LimitsSettings,
        *,
        clock: Callable[[], float],
        fair: FairShare,
        store: Store | None = None,
    ) -> None:
        self.table = table
        self.fair = fair  # the gateway queue's: corrected from usage at the end
        self.limits = limits
        self._clock = clock
        self.local = LocalStore(clock)
        self.store = store  # shared counters; None: in this process
        self.store_up = True
        self._retry_at = 0.0
        self._restore = False  # the next renewal adds back the leases the store lost
        self.stats: dict[str, KeyStats] = {t.name: KeyStats() for t in table}
        self._leaving: dict[str, KeyStats] = {}  # revoked keys' with requests still in flight
        self._pending: set[asyncio.Task[bool]] = set()  # store calls no request waits for
        # The shared max_concurrency's leases this replica holds, by key: renewed until left.
        self._replica = os.urandom(6).hex()
        self._leases = itertools.count()
        self._held: dict[str, set[str]] = {}

    def configure(self, table: KeyTable, limits: LimitsSettings) -> list[str]:
        """A reloaded key table; returns the names that went (their tallies go with them, but for
        one added back while its requests still run)."""
        self.table, self.limits = table, limits
        names = set(table.names())
        gone = [n for n in self.stats if n not in names]
        for name in gone:
            self._leaving[name] = self.stats.pop(name)
        for name in names:
            if name not in self.stats:  # a key added back while its requests run still counts them
                self.stats[name] = self._leaving.pop(name) if name in self._leaving else KeyStats()
        self._leaving = {n: s for n, s in self._leaving.items() if s.in_flight > 0}
        self.local.forget(names)
        return gone

    @overload
    def reject(self, stats: KeyStats, reason: str, exc: GatewayError) -> GatewayError: ...
    @overload
    def reject(self, stats: KeyStats, reason: str, exc: None) -> None: ...

    def reject(self, stats: KeyStats, reason: str, exc: GatewayError | None) -> GatewayError | None:
        """Count a refusal of the key's request by ``reason``; returns ``exc``, to raise."""
        stats.rejections[reason] = stats.rejections.get(reason, 0) + 1
        return exc

    async def admit(
        self,
        tenant: Tenant,
        facts: RequestFacts,
        model: str | None,
        rec: RequestRecord,
        send: Send,
        *,
        metered: bool = True,
    ) -> tuple[Admission, Send]:
        """The pipeline's step: ``enter``, and the ``send`` that adds its key's headers to the
        response."""
        admission = await self.enter(tenant, facts, model, rec, metered=metered)
        return admission, _with_headers(send, admission.headers) if admission.headers else send

    async def enter(
        self,
        tenant: Tenant,
        facts: RequestFacts,
        model: str | None,
        rec: RequestRecord,
        flow: str | None = None,
        *,
        metered: bool = True,
    ) -> Admission:
        """Admit a request of ``tenant``'s key, reserving its prompt and all the output it may ask
        for (as OpenAI counts; none on a route that is not ``metered``), or raise its refusal;
        ``release`` ends it. The admission's ``headers`` go on its response. ``flow``: the fair
        share's name for it in the key's place (a flow the gateway in front named)."""
        rec.key = tenant.name
        facts.tenant = flow or tenant.name
        cost = facts.prompt_tokens + (facts.max_tokens or 0) if metered else None
        admission = await self.check(tenant, model, cost)
        admission.share = facts.tenant
        return admission

    async def check(self, tenant: Tenant, model: str | None, cost: int | None) -> Admission:
        """Admit one request of ``cost`` reserved tokens (None: its tokens are not limited), or
        raise its refusal. It is counted in a store for its key's rate limits or its concurrency
        shared by the replicas; a key with neither has no window to wait for."""
        admission = self._admissible(tenant, model)
        shared = self.store is not None and tenant.max_concurrency is not None
        if tenant.rate_limited or shared:
            stats = admission.stats
            stats.in_flight += 1  # held while the store is asked: a burst cannot all pass the check
            try:
                await self._count(admission, cost, shared)
            finally:
                stats.in_flight -= 1
        return _admitted(admission)

    async def _count(self, admission: Admission, cost: int | None, shared: bool) -> None:
        """Count the request in its key's window (``shared``: with a lease on a concurrency slot
        the replicas count together), or raise its refusal."""
        tenant, stats = admission.tenant, admission.stats
        lease = f"{self._replica}:{next(self._leases)}" if shared else ""
        counts = await self._hit(tenant, stats, cost, lease)
        if counts is None:  # the store is down and the limits fail open
            if lease:  # held all the same: the renewal after the store is back adds it there
                admission.lease = lease
                self._held.setdefault(tenant.name, set()).add(lease)
            return
        if counts.busy:
            raise self.reject(stats, "concurrency", _busy(tenant, counts, self.limits.window))
        stats.last = counts
        window = self.limits.window
        if not counts.admitted:
            refused = refusal(tenant, counts, cost or 0, window)
            raise self.reject(stats, refused.type, refused)
        admission.headers = rate_headers(tenant, counts, window)
        admission.reserved, admission.bucket = cost or 0, counts.bucket
        if lease:
            admission.lease = lease
            self._held.setdefault(tenant.name, set()).add(lease)

    def _admissible(self, tenant: Tenant, model: str | None) -> Admission:
        """The key's request before its rate limits (not counted yet), or the refusal for a model
        it may not use or a concurrency limit it has reached."""
        stats = self.stats.get(tenant.name)
        if stats is None:  # a key revoked while its request was being read: tallied nowhere
            stats = KeyStats()
        if tenant.models is not None and model is None:  # the engine would pick its own model
            raise self.reject(
                stats,
                "missing_model",
                BadRequest(
                    "This key may use only some models: name one in 'model' (GET /v1/models lists them).",
                    code="missing_model",
                    param="model",
                ),
            )
        if tenant.models is not None and model is not None and model not in tenant.models:
            raise self.reject(
                stats,
                "model_not_allowed",
                NotFound(
                    f"The model `{model[:128]}` does not exist or you do not have access to it.",
                    code="model_not_found",
                    param="model",
                ),
            )
        if tenant.max_concurrency is not None and stats.in_flight >= tenant.max_concurrency:
            raise self.reject(stats, "concurrency", _busy(tenant, stats.last, self.limits.window))
        return Admission(tenant, stats, [], share=tenant.name)

    async def _hit(self, tenant: Tenant, stats: KeyStats, cost: int | None, lease: str) -> Counts | None:
        window_ms = max(1, round(self.limits.window * 1000))
        rpm, tpm = tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0
        if cost is None:  # not metered: its tokens are not asked of the window
            cost, tpm = 0, 0
        if self.store is None:
            return self.local.hit_now(tenant.name, window_ms, rpm=rpm, tpm=tpm, cost=cost)
        now = self._clock()
        if self.store_up or now >= self._retry_at:
            if not self.store_up:  # this request tries the failed store; the others leave it a second more
                self._retry_at = now + STORE_RETRY
            try:
                async with asyncio.timeout(self.limits.store_timeout):
                    counts = await self.store.hit(
                        tenant.name,
                        window_ms,
                        rpm=rpm,
                        tpm=tpm,
                        cost=cost,
                        lease=lease,
                        max_concurrency=(tenant.max_concurrency or 0) if lease else 0,
                    )
            except STORE_ERRORS as exc:
                self._failed(exc, now)
            else:
                self._answered()
                return counts
        if self.limits.on_store_error == "fail_open":
            return None
        raise self.reject(
            stats,
            "store_unavailable",
            NoInstance(
                "The rate-limit store cannot be reached and [limits] on_store_error = 'fail_closed'.",
                code="limits_store_unavailable",
                retry_after=1,
            ),
        )

    def _failed(self, exc: BaseException, now: float) -> None:
        if self.store_up:
            log.error(
                "limits store failed (%s: %s): %s until it answers again",
                type(exc).__name__,
                str(exc)[:200] or "timed out",
                "admitting without shared limits"
                if self.limits.on_store_error == "fail_open"
                else "refusing limited keys' requests with 503",
            )
        self.store_up = False
        self._retry_at = now + STORE_RETRY
        self._restore = True  # the leases held may lapse (or go with a restart) meanwhile

    def _answered(self) -> None:
        """The store answered: if it was down, say it is back."""
        if not self.store_up:
            log.warning("limits store is back: shared limits hold again")
            self.store_up = True

    def release(self, admission: Admission | None, rec: RequestRecord) -> None:
        """The pipeline's last step, whatever the path: ``finish`` from the request's record, and
        its fair-share counter corrected from the prompt estimates charged at dispatch (one per
        attempt: a retry is dispatched again) to its usage."""
        if admission is None:
            return
        # An instance's own error answer (relayed whole: a 400, a 500) generated nothing and is not
        # charged; the gateway's timeouts and a client gone mid-request are, the instance may
        # have worked for them.
        refused = rec.ttfb is not None and rec.status >= 400 and rec.status != 499 and not rec.stream
        served = rec.instance is not None and not refused
        if rec.reject is not None:  # refused after its key's limits: the queue, no instance, ...
            self.reject(admission.stats, rec.reject, None)
        self.finish(admission, rec.prompt_tokens, rec.completion_tokens, served)
        if served and (rec.prompt_tokens is not None or rec.completion_tokens):
            estimate = rec.prompt_tokens_est or 0
            used = (rec.prompt_tokens or estimate) + (rec.completion_tokens or 0)
            self.fair.charge(admission.share, used - estimate * (rec.retries + 1))

    def finish(self, admission: Admission, prompt: int | None, completion: int | None, served: bool) -> None:
        """End of a request (idempotent): its concurrency slot back, its tokens tallied and settled
        (usage less the reservation; nothing served gives all of it back)."""
        if admission.released:
            return
        admission.released = True
        if admission.lease:
            self._leave(admission.tenant.name, admission.lease)
        stats = admission.stats
        stats.in_flight -= 1
        stats.prompt_tokens += prompt or 0
        stats.completion_tokens += completion or 0
        if admission.bucket is None:
            return
        if prompt is None and completion is None:
            if served:
                return  # usage unknown: the reservation stands
            actual = 0
        else:
            actual = (prompt or 0) + (completion or 0)
        delta = actual - admission.reserved
        if delta == 0:
            return
        name = admission.tenant.name
        if self.store is None:
            self.local.settle_now(name, admission.bucket, delta)
        elif self.store_up:
            self._later(self.store.settle(name, admission.bucket, delta))

    def _leave(self, name: str, lease: str) -> None:
        """The request's shared lease given back (if the store fails, it lapses on its own)."""
        held = self._held.get(name)
        if held is not None:
            held.discard(lease)
            if not held:
                del self._held[name]
        if self.store is not None and self.store_up:
            self._later(self.store.leave(name, lease))

    async def renew(self) -> None:
        """Every lease this replica holds renewed, so only a stopped replica's lapse (the gateway
        calls it every ``LEASE_RENEW_S``). After the store was down, those it lost are added
        again, or the replicas would admit past ``max_concurrency`` until these requests end (one
        ending just then may leave its lease to lapse: a slot short for ``LEASE_TTL_MS`` at most);
        so are those of requests admitted while it was down. A replica holding none asks a failed
        store whether it is back, so its metric and ``status`` say so without waiting for traffic."""
        store = self.store
        if store is None or not (self.store_up or self._clock() >= self._retry_at):
            return
        if not self._held:
            if not self.store_up and await self._call(store.ping()):  # idle: is it back?
                self._answered()
            return
        restore, self._restore = self._restore, False
        for name, held in list(self._held.items()):
            if not await self._call(store.renew(name, sorted(held), restore)):
                return  # _failed: the next renewal restores
        self._answered()

    def _later(self, call: Coroutine[Any, Any, None]) -> None:
        """A store call the request does not wait for (kept until done, as asyncio asks)."""
        task = asyncio.get_running_loop().create_task(self._call(call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _call(self, call: Coroutine[Any, Any, None]) -> bool:
        """One store call, bounded by ``store_timeout``; its failure is the store's (False)."""
        try:
            async with asyncio.timeout(self.limits.store_timeout):
                await call
        except STORE_ERRORS as exc:
            self._failed(exc, self._clock())
            return False
        return True

    def summary(self) -> dict[str, Any]:
        """Where the limits are counted, and whether that store answers."""
        return {
            "store": "redis" if self.store is not None else "in-process",
            "store_up": self.store_up,
            "on_store_error": self.limits.on_store_error,
            "window_seconds": self.limits.window,
        }

    async def aclose(self) -> None:
        for task in list(self._pending):
            task.cancel()
        if self.store is not None:
            await self.store.aclose()


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    """``send`` that adds ``extra`` to the response's headers, whichever way the response goes."""

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], *extra]}
        await send(message)

    return sending
