"""The KV-events subscriber: one ZMQ SUB socket per instance that publishes, feeding its index.

The gateway binds the instance's ``kv_events`` endpoint where vLLM connects to it (a specific
address), and connects where vLLM binds (wildcard, IPv6, ipc), as it does to the replay socket. Each
batch goes to the instance's ``KvIndex`` in order; on a gap the missing batches are asked for
(``kv_events_replay``), else the index starts over and dispatch uses the approximate model until it
is complete again. Only rank 0 of a data-parallel engine is subscribed. Frames are bounded, and a
bind beyond loopback is warned about. pyzmq and msgpack are the ``precise`` extra, imported only
when an instance has ``kv_events``. The full rules: benchmarks/README.md, "Design notes moved from
the code".
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Iterable
from typing import Any, Final
from urllib.parse import urlsplit

from taogate.dispatch.blocks import publisher_binds
from taogate.fleet.instance import Instance
from taogate.fleet.kv_index import KvIndex
from taogate.settings import ConfigError, Settings

__all__ = ["KvEventsSubscriber", "replay_endpoint", "require_precise", "subscriber_endpoint"]

log = logging.getLogger("taogate.health")

_END: Final = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT: Final = 2.0
MAX_FRAME: Final = 16 << 20  # bytes: a batch is one engine step's events
RECEIVE_HWM: Final = 10_000  # batches queued per socket before ZMQ drops (seen as a gap)
# An engine step's events: a few per request scheduled, each with at most the step's token ids.
_UNPACK_LIMITS: Final = {
    "max_array_len": 1 << 21,
    "max_map_len": 64,
    "max_str_len": 1 << 16,
    "max_bin_len": 1 << 16,
    "max_ext_len": 1 << 10,
}
BIND_BACKOFF: Final = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # ZMQ releases a closed socket's port later
_WILDCARDS: Final = frozenset({"*", "0.0.0.0", "[::]", "::"})
_LOOPBACK: Final = ("127.", "localhost", "[::1]")
PRECISE_MODULES: Final = ("zmq", "msgpack")


def require_precise(settings: Settings) -> None:
    """ConfigError when an instance has ``kv_events`` and pyzmq or msgpack is not installed."""
    items = [*settings.instances, *([settings.overflow] if settings.overflow else [])]
    if not any(i.kv_events for i in items):
        return
    for module in PRECISE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(
                f"kv_events needs the `{module}` package (precise prefix-cache dispatch): "
                "pip install 'taogate[precise]', or remove kv_events"
            ) from None


def _tcp(endpoint: str) -> tuple[str, str] | None:
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    return (host, port) if sep else None


def _on_instance_host(endpoint: str, url: str) -> str:
    """A wildcard's port on the instance's own host (a wildcard cannot be connected to)."""
    parts = _tcp(endpoint)
    host = urlsplit(url).hostname
    if parts is None or parts[0] not in _WILDCARDS or not host:
        return endpoint
    return f"tcp://[{host}]:{parts[1]}" if ":" in host else f"tcp://{host}:{parts[1]}"


def subscriber_endpoint(endpoint: str, url: str) -> tuple[bool, str]:
    """(connect, address): what the gateway's SUB socket does with an instance's ``kv_events``."""
    if publisher_binds(endpoint):
        return True, _on_instance_host(endpoint, url)
    return False, endpoint


def replay_endpoint(endpoint: str, url: str) -> str:
    """Where the gateway's DEALER connects: vLLM binds its replay ROUTER whatever the address."""
    return _on_instance_host(endpoint, url)


def _decode(payload: bytes) -> tuple[float | None, list[Any]]:
    """(ts, events) of one batch; ValueError (or msgpack's own errors) when it is not one."""
    msgpack = importlib.import_module("msgpack")
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, **_UNPACK_LIMITS)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch [ts, events, rank]")
    ts = batch[0]
    return (float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None), batch[1]


def _bounded(zmq: Any, sock: Any) -> Any:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    return sock


def _where(inst: Instance) -> tuple[str | None, ...]:
    """What a subscription is made from: another value needs another one."""
    return inst.spec.kv_events, inst.spec.kv_events_replay, inst.spec.url


class KvEventsSubscriber:
    """Owns the subscriber tasks; ``sync`` after every change of the instance list.

    ``precise``: requests' own block hashes can be made (``[prefill] tokenizer``); without them an
    index would cost CPU and memory for nothing, so nothing is subscribed."""

    def __init__(self, fleet: Iterable[Instance], *, precise: bool = True) -> None:
        self._fleet = fleet
        self.precise = precise
        self._tasks: dict[str, tuple[tuple[str | None, ...], Instance, asyncio.Task[None]]] = {}
        self._told: set[tuple[str, str]] = set()  # (instance, what): said once

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
        for name, inst in wanted.items():
            if name not in self._tasks:
                task = asyncio.get_running_loop().create_task(
                    self._run(inst, previous.get(name)), name=f"kv-events {name}"
                )
                task.add_done_callback(self._ended)
                self._tasks[name] = (_where(inst), inst, task)

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
        tasks = [task for _, _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, inst: Instance, after: asyncio.Task[None] | None) -> None:
        if after is not None:  # the subscription it replaces closes its socket first
            await asyncio.wait([after])
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        connect, endpoint = subscriber_endpoint(inst.spec.kv_events or "", inst.spec.url)
        sock = _bounded(zmq, context.socket(zmq.SUB))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        index: KvIndex | None = None
        try:
            if not await self._attach(inst, sock, connect, endpoint):
                return
            index = inst.cache.enable_index()
            log.info("instance %s: indexing KV events from %s", inst.name, endpoint)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                await self._batch(inst, index, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sock.close()
            if index is not None and inst.cache.index is index:
                inst.cache.disable_index()

    async def _attach(self, inst: Instance, sock: Any, connect: bool, endpoint: str) -> bool:
        zmq = importlib.import_module("zmq")
        parts = _tcp(endpoint)
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
            "instance %s: KV events on %s unavailable (%s); approximate mode until the next reload",
            inst.name,
            endpoint,
            error,
        )
        return False

    async def _batch(self, inst: Instance, index: KvIndex, seq: int, payload: bytes) -> None:
        try:
            ts, events = _decode(payload)
            outcome = index.apply(seq, events, ts)
        except Exception as exc:  # not a batch we can read: what it changed is unknown
            self._once(
                inst.name,
                "malformed",
                logging.WARNING,
                "instance %s: unreadable KV event batch (%r); the index starts over",
                inst.name,
                exc,
            )
            index.start_over()
            return
        if index.off is not None:
            self._once(
                inst.name,
                f"off {index.off}",
                logging.WARNING,
                "instance %s: precise mode off: %s; the approximate cache model is used",
                inst.name,
                index.off,
            )
        if outcome != "gap":
            return
        missing = index.next_seq
        if inst.spec.kv_events_replay and missing is not None and await self._replay(inst, index, missing):
            return
        log.info("instance %s: KV events lost before seq %d; index starts over", inst.name, seq)
        index.start_over()
        index.apply(seq, events, ts)

    async def _replay(self, inst: Instance, index: KvIndex, start: int) -> bool:
        """Ask the engine for every batch from ``start``; True when they filled the gap."""
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        dealer = _bounded(zmq, context.socket(zmq.DEALER))
        filled = False
        try:
            dealer.connect(replay_endpoint(inst.spec.kv_events_replay or "", inst.spec.url))
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT):
                first = True
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == _END:
                        break
                    seq = int.from_bytes(frames[2], "big")
                    if first and seq != start:
                        return False  # the engine no longer has them
                    first = False
                    ts, events = _decode(frames[3])
                    if index.apply(seq, events, ts) == "gap":
                        return False
                    filled = True
        except Exception:  # timeout, ZMQ, an unreadable batch: the caller starts over
            return False
        finally:
            dealer.close()
        if filled:
            index.replayed()
        return filled

    def __len__(self) -> int:
        return len(self._tasks)
