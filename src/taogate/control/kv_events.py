"""The KV-events subscriber: one ZMQ SUB socket per instance that publishes, feeding its index.

Where it binds or connects: ``control.kv_endpoints``. A subscription is ``live`` once the publisher
is connected: the gateway's own first traffic (warm-up) waits for it. With ``kv_events_replay``
the engine is then asked for every batch from 0, so an engine started first is indexed whole at
once; later gaps are asked for the same way, and a silent replay socket again later
(``control.kv_replay``). Each batch (``control.kv_wire``) goes to the instance's ``KvIndex`` in
sequence; what it cannot prove complete waits for the proofs ``fleet.kv_index`` lists, helped by
the engine's scraped counters. Every change of the index's trust is said in one log line
(``fleet.kv_trust``). A subscription that ends, for any reason, takes its index with it.

Data parallel: vLLM publishes rank r on the endpoint's port + r. Only the endpoint given is
subscribed, rank 0's: its index is sized as one rank's share of the blocks, and a hit it counts
may land on another rank (vLLM's API server balances between them).

Anyone who reaches a bound SUB socket can publish into it: frames and msgpack containers are
bounded, and a bind on anything but loopback is warned about.
pyzmq and msgpack are the ``precise`` extra: imported only when an instance has ``kv_events``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from taogate.control.kv_endpoints import subscriber_endpoint, tcp_parts
from taogate.control.kv_replay import Replays
from taogate.control.kv_wire import bounded, decode
from taogate.control.loops import cancel_all
from taogate.fleet.engine import EngineSample
from taogate.fleet.instance import Instance
from taogate.fleet.kv_index import KvIndex
from taogate.fleet.kv_trust import Trust, trust_message

__all__ = ["KvEventsSubscriber"]

log = logging.getLogger("taogate.health")

LIVE_WAIT: Final = 2.0  # seconds the gateway's first traffic to an instance waits for its publisher
LIVE_GRACE: Final = 0.05  # after the handshake, for the subscription to reach the publisher
IDLE_CHECK: Final = 1.0  # seconds between looks at the engine's counters while untrusted and idle
IDLE_MAX: Final = 30.0  # ... growing to this while no new scrape comes
COUNTER_LAG: Final = 0.5  # a scrape bounds the unseen blocks only when this much later than their start
BIND_BACKOFF: Final = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # ZMQ releases a closed socket's port later
_LOOPBACK: Final = ("127.", "localhost", "[::1]")


def _where(inst: Instance) -> tuple[str | None, ...]:
    """What a subscription is made from: another value needs another one."""
    return inst.spec.kv_events, inst.spec.kv_events_replay, inst.spec.url


def blocks_ever(engine: EngineSample, block_size: int, capacity: int) -> int | None:
    """At most the blocks the engine ever cached: every full block of the tokens it processed
    since it started, and every block in use now (a running request's tokens may not be counted
    yet). None when its /metrics do not say."""
    if engine.prompt_tokens is None or engine.generation_tokens is None or engine.kv_usage is None:
        return None
    processed = math.ceil((engine.prompt_tokens + engine.generation_tokens) / max(1, block_size))
    return processed + math.ceil(engine.kv_usage * capacity * max(1, engine.engines))


class KvEventsSubscriber:
    """Owns the subscriber tasks; ``sync`` after every change of the instance list.

    ``precise``: requests' own block hashes can be made (``[prefill] tokenizer``); without them an
    index would cost CPU and memory for nothing, so nothing is subscribed."""

    def __init__(
        self, fleet: Iterable[Instance], *, precise: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._fleet = fleet
        self.precise = precise
        self._clock = clock  # the scraper's: ``Instance.engine_at`` is read against it
        self._tasks: dict[str, tuple[tuple[str | None, ...], Instance, asyncio.Task[None]]] = {}
        self._live: dict[str, asyncio.Event] = {}  # set once the instance's publisher is connected
        self._said: dict[str, Trust] = {}  # the trust last said per instance
        self.replays = Replays(clock)  # asks of the engines' replay sockets
        self._told: set[tuple[str, str]] = set()  # (instance, what): said once
        self._ending: set[asyncio.Task[None]] = set()  # cancelled by ``sync``, not ended yet

    def _once(self, name: str, what: str, level: int, msg: str, *args: object) -> None:
        if (name, what) not in self._told:
            self._told.add((name, what))
            log.log(level, msg, *args)

    def sync(self) -> None:
        wanted = {i.name: i for i in self._fleet if i.spec.kv_events}
        if not self.precise:
            for name in wanted:
                self._once(
                    name,
                    "tokenizer",
                    logging.WARNING,
                    "instance %s: kv_events ignored: precise dispatch needs [prefill] tokenizer "
                    "(and its packages)",
                    name,
                )
            wanted = {}
        previous: dict[str, asyncio.Task[None]] = {}
        for name, (where, inst, task) in list(self._tasks.items()):
            if task.done():  # it ended by itself (bind failed, or it failed): retried below
                del self._tasks[name]
                continue
            new = wanted.get(name)
            if new is None or new is not inst or _where(new) != where:
                task.cancel()  # its index goes when it ends
                del self._tasks[name]
                previous[name] = task
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)
        for name in set(self._live) - set(wanted):
            self._live.pop(name).set()
        present = {i.name for i in self._fleet}  # what is said of instances gone goes with them
        for name in set(self._said) - present:
            del self._said[name]
        self._told = {told for told in self._told if told[0] in present}
        for name, inst in wanted.items():
            if name not in self._tasks:
                live = self._live[name] = asyncio.Event()
                task = asyncio.get_running_loop().create_task(
                    self._run(inst, previous.get(name), live), name=f"kv-events {name}"
                )
                task.add_done_callback(self._ended)
                self._tasks[name] = (_where(inst), inst, task)

    async def live(self, inst: Instance) -> None:
        """Return once ``inst``'s publisher is connected (at most ``LIVE_WAIT`` s): what it publishes
        about traffic sent after this is in its index. At once for an instance not subscribed."""
        event = self._live.get(inst.name)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LIVE_WAIT):
                    await event.wait()

    @staticmethod
    def _ended(task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error(
                "%s: the subscription failed (%r); the approximate cache model is used", task.get_name(), exc
            )

    async def stop(self) -> None:
        tasks = [task for _, _, task in self._tasks.values()] + list(self._ending)
        self._tasks.clear()
        await cancel_all(tasks, "KV-events")

    async def _run(self, inst: Instance, after: asyncio.Task[None] | None, live: asyncio.Event) -> None:
        if after is not None:  # the subscription it replaces closes its socket first
            await asyncio.wait([after])
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        connect, endpoint = subscriber_endpoint(inst.spec.kv_events or "", inst.spec.url)
        sock = bounded(zmq, context.socket(zmq.SUB))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        index: KvIndex | None = None
        try:
            if not await self._attach(inst, sock, connect, endpoint):
                return
            index = inst.cache.enable_index()
            self._said.pop(inst.name, None)
            log.info("instance %s: indexing KV events from %s", inst.name, endpoint)
            if not await self._peer(zmq, monitor):
                index.note(f"no publisher connected to {endpoint} within {LIVE_WAIT:g} s")
                log.warning(
                    "instance %s: no KV-event publisher connected to %s within %g s (the engine's "
                    "--kv-events-config endpoint, or a firewall between it and this host?): until "
                    "one does, the index holds only what a replay or the engine's idle counters said",
                    inst.name,
                    endpoint,
                    LIVE_WAIT,
                )
            live.set()
            self.replays.begin(inst.name)
            if inst.spec.kv_events_replay:
                await self.replays.ask_whole(inst, index)
            self._say(inst, index)
            await self._listen(inst, index, sock)
        finally:
            live.set()
            self.replays.end(inst.name)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close()
            sock.close()
            if index is not None and inst.cache.index is index:
                inst.cache.disable_index()

    @staticmethod
    async def _peer(zmq: Any, monitor: Any) -> bool:
        """Wait for the publisher's handshake (at most ``LIVE_WAIT`` s)."""
        parse = importlib.import_module("zmq.utils.monitor").parse_monitor_message
        try:
            async with asyncio.timeout(LIVE_WAIT):
                while parse(await monitor.recv_multipart())["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    pass
        except TimeoutError:
            return False
        await asyncio.sleep(LIVE_GRACE)
        return True

    async def _listen(self, inst: Instance, index: KvIndex, sock: Any) -> None:
        epoch, since = index.epoch, self._clock()
        idle, scraped = IDLE_CHECK, inst.engine_at
        replays = self.replays
        while True:
            frames: list[bytes] | None = None
            # Untrusted: look at the engine's counters now and then, and ask a silent replay again.
            wait = math.inf if index.trusted or not index.tracking else idle
            if not index.trusted:
                wait = min(wait, replays.due(inst.name))
            if wait == math.inf:
                frames = await sock.recv_multipart()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        frames = await sock.recv_multipart()
            if frames is not None and len(frames) == 3:
                await self._batch(inst, index, int.from_bytes(frames[1], "big"), frames[2])
            if index.trusted:
                replays.needless(inst.name)
            elif replays.due(inst.name) == 0:
                await replays.ask_whole(inst, index)
                self._say(inst, index)
            if index.epoch != epoch:
                epoch, since = index.epoch, self._clock()
            if not index.trusted and index.tracking:
                self._bound(inst, index, since)
            # No new scrape since the last look: look less often (scrapes may be far apart).
            idle = IDLE_CHECK if inst.engine_at != scraped else min(2 * idle, IDLE_MAX)
            scraped = inst.engine_at

    def _bound(self, inst: Instance, index: KvIndex, since: float) -> None:
        """The engine's counters, scraped after the index's unseen blocks began, bound them."""
        engine = inst.engine
        if engine is None or inst.engine_at < since + COUNTER_LAG:
            return
        ever = blocks_ever(engine, index.block_size, index.capacity)
        if ever is not None:
            index.bound_unknown(ever)
            self._say(inst, index)

    def _say(self, inst: Instance, index: KvIndex) -> None:
        """One line each time the reason the index is (not) trusted changes."""
        trust = Trust("off", index.off) if index.off is not None else index.trust
        said = self._said.get(inst.name)
        if said is not None and said.reason == trust.reason:
            return
        self._said[inst.name] = trust
        message = trust_message(inst.name, trust, replay=bool(inst.spec.kv_events_replay))
        log.log(logging.INFO if trust.trusted else logging.WARNING, "%s", message)

    async def _attach(self, inst: Instance, sock: Any, connect: bool, endpoint: str) -> bool:
        zmq = importlib.import_module("zmq")
        parts = tcp_parts(endpoint)
        if not connect and parts is not None and not parts[0].startswith(_LOOPBACK):
            log.warning(
                "instance %s: KV events bound on %s: anyone who reaches it can steer dispatch; "
                "firewall it to the vLLM hosts",
                inst.name,
                endpoint,
            )
        for delay in (0.0, *BIND_BACKOFF):
            await asyncio.sleep(delay)
            try:
                (sock.connect if connect else sock.bind)(endpoint)
                return True
            except zmq.ZMQError as exc:
                error = exc
        log.warning(
            "instance %s: KV events on %s unavailable (%s); approximate mode until it is tried again "
            "(the next reload or change of the fleet)",
            inst.name,
            endpoint,
            error,
        )
        return False

    async def _batch(self, inst: Instance, index: KvIndex, seq: int, payload: bytes) -> None:
        try:
            await self._one(inst, index, seq, payload)
        finally:
            self._say(inst, index)

    async def _one(self, inst: Instance, index: KvIndex, seq: int, payload: bytes) -> None:
        try:
            ts, events = decode(payload)
            outcome = index.apply(seq, events, ts)
        except Exception as exc:  # not a batch we can read: what it changed is unknown
            index.start_over("unreadable", f"batch {seq} could not be read ({exc!r})")
            return
        replay = inst.spec.kv_events_replay
        if outcome == "restart" and not index.trusted and replay:  # its first batches were missed
            index.start_over("restart_missed", index.trust.detail)
            if not await self.replays.ask_whole(inst, index):
                _apply_anew(index, seq, events, ts)
            return
        if outcome != "gap":
            return
        missing = index.next_seq
        filled: bool | None = False
        if replay and missing is not None:
            filled = await self.replays.fill_gap(inst, index, missing)
        if filled:
            return
        if filled is None:
            why = "the engine's replay did not answer; it is asked again later"
        else:
            why = "the engine's replay no longer has them" if replay else "kv_events_replay is not set"
        index.start_over("gap", f"batches {missing}..{seq - 1} lost ({why})")
        _apply_anew(index, seq, events, ts)

    def __len__(self) -> int:
        return len(self._tasks)


def _apply_anew(index: KvIndex, seq: int, events: list[Any], ts: float | None) -> None:
    """The batch that made ``index`` start over, applied to it: one it cannot read (only its
    number was looked at so far) starts it over again, and the subscription goes on."""
    try:
        index.apply(seq, events, ts)
    except Exception as exc:
        index.start_over("unreadable", f"batch {seq} could not be read ({exc!r})")
