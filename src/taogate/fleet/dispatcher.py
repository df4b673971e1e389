"""Admission: turn a pure dispatch decision into a held lease, or a bounded wait, or a refusal.

``try_acquire()`` asks ``admission.decide`` (pure) over a fresh snapshot of the fleet (``Fleet.views``):

* ``Send``   → a Lease on that instance, at once;
* ``Wait``   → every eligible instance is at its cap: join the bounded gateway queue. Whenever a
  slot frees (a lease is released, an instance comes up, a drain ends, config reloads) ``pump()``
  hands slots to waiters by fair share between client keys, then priority class, arrival order
  within one, the oldest waiter served at least once every ``oldest_every`` grants
  (``fleet.priority``), so no request waits while an
  eligible instance has room (work-conserving). Queue full or wait too long → 429 with Retry-After
  from the drain rate; a sheddable request (``shed``) is refused so at once instead of waiting;
* ``Refuse`` → 503 (no instance can take this request at all) or 404 (model served by none), also
  to a waiter whose instances went away meanwhile (``recheck``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from taogate.dispatch.admission import candidates, decide, retry_after_seconds
from taogate.dispatch.policy import LeastBusy, Policy, RoundRobin
from taogate.dispatch.receipt import explain
from taogate.dispatch.types import InstanceView, Refuse, RequestFacts, Send, Wait
from taogate.errors import GatewayError, NoInstance, NotFound, Overloaded
from taogate.fleet.fleet import Fleet
from taogate.fleet.lease import Lease
from taogate.fleet.priority import FairOrder
from taogate.tenancy.fairshare import FairShare

log = logging.getLogger("taogate.dispatch")


@dataclass(slots=True)
class _Waiter:
    facts: RequestFacts
    exclude: frozenset[str]
    future: asyncio.Future[tuple[Lease, Send]]
    key: tuple[int, int]  # (priority, arrival number): the queue's order within its client key
    tenant: str  # the client key: the queue's fair share between keys


@dataclass(slots=True)
class DrainRate:
    """Completions per second over a short window, for Retry-After estimates."""

    window: float = 10.0
    _stamps: deque[float] = field(default_factory=deque)

    def tick(self, now: float) -> None:
        stamps = self._stamps
        stamps.append(now)
        cutoff = now - self.window  # ``_trim``, inline: once per completion
        while stamps and stamps[0] < cutoff:
            stamps.popleft()
        while len(stamps) > 100_000:
            stamps.popleft()

    def rate(self, now: float) -> float:
        self._trim(now)
        return len(self._stamps) / self.window

    def _trim(self, now: float) -> None:
        cutoff = now - self.window
        stamps = self._stamps
        while stamps and stamps[0] < cutoff:
            stamps.popleft()
        # Bounded: at most one stamp per completion in the window; cap for pathological rates.
        while len(stamps) > 100_000:
            stamps.popleft()


@dataclass(frozen=True, slots=True)
class QueueRules:
    """What a config decides for the dispatcher: its policy and its queue's bounds (one value, so a
    reload hands over a new one whole; the queue and the requests in it stay)."""

    policy: Policy
    queue_size: int
    queue_timeout: float
    oldest_every: int = 4


class Dispatcher:
    """Owns the gateway wait queue; one per gateway."""

    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        *,
        queue_size: int,
        queue_timeout: float,
        clock: Callable[[], float],
        oldest_every: int = 4,
    ) -> None:
        self.fleet = fleet
        self._rules = QueueRules(policy, queue_size, queue_timeout, oldest_every)
        self._clock = clock
        self.fair = FairShare()  # tokens served per client key: charged at dispatch, settled at the end
        self._waiters: FairOrder[_Waiter] = FairOrder(oldest_every, self.fair)
        self._arrivals = itertools.count()
        self._drain = DrainRate()
        self._closed: GatewayError | None = None  # ``fail_all``'s: nothing is sent or queued after it

    @property
    def rules(self) -> QueueRules:
        return self._rules

    @rules.setter
    def rules(self, rules: QueueRules) -> None:
        """A reloaded config's rules, for the requests from now on and those already queued."""
        self._rules = rules
        self._waiters.oldest_every = rules.oldest_every

    @property
    def policy(self) -> Policy:
        return self._rules.policy

    @property
    def queue_size(self) -> int:
        return self._rules.queue_size

    @property
    def queue_timeout(self) -> float:
        return self._rules.queue_timeout

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> int:
        return retry_after_seconds(len(self._waiters), self._drain.rate(self._clock()))

    # -- the decision --------------------------------------------------------------------------
    def _try(self, facts: RequestFacts, exclude: frozenset[str]) -> tuple[Lease, Send] | Wait | Refuse:
        now = self._clock()
        views: list[InstanceView] = self.fleet.views(now)
        decision = decide(facts, views, self._rules.policy, exclude)
        if isinstance(decision, Send):
            receipt = self._receipt(facts, views, decision, exclude) if facts.receipt else None
            inst = self.fleet.get(decision.instance)
            self.fair.charge(facts.tenant, facts.prompt_tokens)
            trial = False if inst.breaker_closed else inst.breaker.on_dispatch(now)  # CLOSED: no trial
            ticket = inst.cache.dispatched(facts) if self.fleet.caching and inst.cache.caching else None
            lease = Lease(
                inst,
                facts.prompt_tokens,
                self._released,
                trial=trial,
                sent_at=now,
                stream=facts.stream,
                max_tokens=facts.max_tokens,
                work=decision.work,
                ticket=ticket,
            )
            lease.receipt = receipt
            return lease, decision
        return decision

    def lease_on(self, name: str, facts: RequestFacts) -> Lease | None:
        """A lease on the named instance, outside the policy: a proxy in front of the gateway sent
        the request there itself (the endpoint picker's fallbacks). None: no such instance."""
        inst = self.fleet.find(name)
        if inst is None:
            return None
        return Lease(
            inst,
            facts.prompt_tokens,
            self._released,
            sent_at=self._clock(),
            stream=facts.stream,
            max_tokens=facts.max_tokens,
        )

    def _receipt(
        self, facts: RequestFacts, views: list[InstanceView], send: Send, exclude: frozenset[str]
    ) -> str:
        """Why ``send``: the estimates as they stood before the lease booked it (``dispatch.receipt``);
        a policy that does not estimate is explained with the estimate it ignored."""
        pricer = self.policy if isinstance(self.policy, LeastBusy) else LeastBusy()
        room = candidates(facts, views, exclude)
        evidence = {v.name: self.fleet.get(v.name).cache.evidence(facts) for v in room}
        line = explain(facts, room, send, pricer, evidence)
        log.debug("route: %s", line)
        return line

    def could_send(self, facts: RequestFacts, exclude: frozenset[str]) -> bool:
        """Whether some instance outside ``exclude`` can take this request now or after a wait.

        Asks with a throwaway policy: the real one keeps memory (rotation, warm prefixes) that a
        question must not move."""
        views = self.fleet.views(self._clock())
        return not isinstance(decide(facts, views, RoundRobin(), exclude), Refuse)

    def _refusal(self, refuse: Refuse, facts: RequestFacts) -> GatewayError:
        if refuse.reason == "model_not_found":
            known = ", ".join(sorted(self.fleet.known_models())) or "(none learned yet)"
            return NotFound(
                f"The model '{facts.model}' does not exist on any instance. Known models: {known}.",
                code="model_not_found",
                param="model",
            )
        if refuse.reason == "no_instance":
            return NoInstance(
                "No healthy instance can take this request right now "
                f"({self.fleet.describe_unavailable(self._clock())}).",
                retry_after=max(1, math.ceil(self.fleet.health_interval)),
            )
        if refuse.reason == "shed":
            why = ", and this request's objective has a negative priority: it is shed, not queued."
        else:
            why = " and the gateway queue is full."
        return Overloaded(
            "Every eligible instance is at max_queue_per_instance" + why,
            code=refuse.reason,
            retry_after=self.retry_after(),
        )

    def try_acquire(
        self, facts: RequestFacts, exclude: frozenset[str] = frozenset()
    ) -> tuple[Lease, Send] | None:
        """A lease on the instance to send to now, with its pick, or None when every eligible
        instance is at its cap (then ``wait_for_slot``); refusals raise. Not a coroutine: the
        common case needs no wait."""
        if self._closed is not None:  # draining: nothing new is sent (a retry out of its backoff)
            raise self._closed
        got = self._try(facts, exclude)
        if isinstance(got, Refuse):
            raise self._refusal(got, facts)
        return None if isinstance(got, Wait) else got

    async def wait_for_slot(
        self,
        facts: RequestFacts,
        exclude: frozenset[str],
        waited: Callable[[float], None],
        *,
        shed: bool = False,
    ) -> tuple[Lease, Send]:
        """Join the bounded queue until ``pump`` hands this request a slot (or 429; or 503 or 404 if
        meanwhile no instance can take it). A ``shed`` request (sheddable, as the Inference
        Extension's negative priorities are) never waits. ``waited`` is told the seconds spent in
        the queue as the request leaves it, with a slot or not (a timed-out wait is the longest)."""
        if shed:
            raise self._refusal(Refuse("shed"), facts)
        if self._closed is not None:  # a request whose body ended after the drain began
            raise self._closed
        if len(self._waiters) >= self.queue_size:
            raise self._refusal(Refuse("queue_full"), facts)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            facts, exclude, loop.create_future(), (facts.priority, next(self._arrivals)), facts.tenant
        )
        self._waiters.add(waiter)
        started = self._clock()
        try:
            async with asyncio.timeout(self.queue_timeout):
                lease, send = await waiter.future
        except BaseException as exc:
            # A slot may have been handed over in the same loop turn as the timeout or the
            # cancellation fired: a timed-out waiter that won the race keeps it; otherwise it goes
            # back at once, so no slot (or breaker trial) is ever held by nobody.
            fut = waiter.future
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            if granted and isinstance(exc, TimeoutError):
                lease, send = fut.result()
                return lease, send
            if granted:
                fut.result()[0].release()
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"Waited {self.queue_timeout:g}s in the gateway queue; every eligible instance "
                    "stayed at max_queue_per_instance.",
                    code="queue_timeout",
                    retry_after=self.retry_after(),
                ) from None
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            waited(self._clock() - started)
        return lease, send

    # -- slots freeing up ------------------------------------------------------------------------
    def _released(self, lease: Lease) -> None:
        self._drain.tick(self._clock())
        if lease.ticket is not None:
            lease.instance.cache.finished(lease.ticket, lease.cached)
        if self._waiters:
            self.pump()

    def pump(self) -> None:
        """Hand free slots to waiters in the queue's order; call whenever capacity may have appeared.
        After each grant the order is asked again (a grant may make the oldest waiter due)."""
        waiters = self._waiters
        while waiters:
            for waiter in waiters.offers():
                if waiter.future.done():
                    continue
                got = self._try(waiter.facts, waiter.exclude)
                if isinstance(got, Wait):
                    if not self.fleet.any_room(self._clock()):
                        return  # nothing anywhere has room: later waiters cannot do better
                    continue
                if isinstance(got, Refuse):
                    self._refuse(waiter, got)
                else:
                    waiters.granted(waiter)
                    waiter.future.set_result(got)
                break
            else:
                return

    def recheck(self) -> None:
        """Capacity may have gone (an instance down, ejected, drained or removed) as well as come:
        the waiters no instance can take any more are refused now (503, or 404 for a model none
        serves), as a request arriving now would be, not at their queue timeout; then ``pump``.
        ``pump`` alone stops at the first waiter when nothing has room, so it cannot see them."""
        views = self.fleet.views(self._clock())
        for waiter in list(self._waiters.offers()):
            if waiter.future.done():
                continue
            got = decide(waiter.facts, views, self._rules.policy, waiter.exclude)
            if isinstance(got, Refuse):
                self._refuse(waiter, got)
        self.pump()

    def _refuse(self, waiter: _Waiter, refused: Refuse) -> None:
        self._waiters.remove(waiter)
        waiter.future.set_exception(self._refusal(refused, waiter.facts))

    def fail_all(self, exc: GatewayError) -> None:
        """Shutdown: refuse everyone still waiting, and any request not sent yet from now on (the
        slots freed at the end of the drain would hand them to a closed upstream pool); the
        requests already sent get the drain's grace."""
        self._closed = exc
        for w in self._waiters.pop_all():
            if not w.future.done():
                w.future.set_exception(exc)
