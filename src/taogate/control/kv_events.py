"""The KV-events subscriber: one ZMQ SUB socket per instance that publishes, feeding its index.

vLLM connects its PUB socket to a non-wildcard endpoint (``kv_events = "tcp://127.0.0.1:5557"`` on
the instance), so the gateway binds that address; to a wildcard or ipc one vLLM binds, and the
gateway connects. Each batch (``[topic, seq, msgpack [ts, events, rank]]``) goes to the instance's
``KvIndex`` in sequence. On a gap, with ``kv_events_replay`` configured, the missing batches are
asked for (a DEALER to vLLM's ROUTER) and applied in order; otherwise, or when the engine no longer
has them, the index starts over and dispatch uses the approximate model until it is complete again.
pyzmq and msgpack are the ``precise`` extra: imported only when an instance has ``kv_events``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from taogate.dispatch.blocks import publisher_binds
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.fleet.kv_index import KvIndex

__all__ = ["KvEventsSubscriber"]

log = logging.getLogger("taogate.health")

_END = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT = 2.0


def _decode(payload: bytes) -> list[Any]:
    msgpack = importlib.import_module("msgpack")
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list):
        return batch[1]
    return []


class KvEventsSubscriber:
    """Owns the subscriber tasks; ``sync`` after every change of the instance list."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task[None]]] = {}

    def sync(self) -> None:
        wanted = {i.name: i for i in self._fleet if i.spec.kv_events}
        for name, (where, task) in list(self._tasks.items()):
            inst = wanted.get(name)
            if inst is None or (inst.spec.kv_events, inst.spec.kv_events_replay) != where:
                task.cancel()
                del self._tasks[name]
        for name, inst in wanted.items():
            if name not in self._tasks:
                where = (inst.spec.kv_events or "", inst.spec.kv_events_replay)
                task = asyncio.get_running_loop().create_task(self._run(inst), name=f"kv-events {name}")
                self._tasks[name] = (where, task)

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, inst: Instance) -> None:
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        endpoint = inst.spec.kv_events or ""
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            try:
                (sock.connect if publisher_binds(endpoint) else sock.bind)(endpoint)
            except zmq.ZMQError as exc:
                log.warning(
                    "instance %s: KV events on %s unavailable (%s); approximate mode",
                    inst.name,
                    endpoint,
                    exc,
                )
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

    async def _batch(self, inst: Instance, index: KvIndex, seq: int, payload: bytes) -> None:
        try:
            events = _decode(payload)
        except Exception:  # not msgpack: count it as lost
            events = None
        if events is not None and index.apply(seq, events) != "gap":
            return
        missing = index.next_seq
        if inst.spec.kv_events_replay and missing is not None and await self._replay(inst, index, missing):
            return
        log.info("instance %s: KV events lost before seq %d; index starts over", inst.name, seq)
        index.start_over()
        if events is not None:
            index.apply(seq, events)

    async def _replay(self, inst: Instance, index: KvIndex, start: int) -> bool:
        """Ask the engine for every batch from ``start``; True when they filled the gap."""
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        filled = False
        try:
            dealer.connect(inst.spec.kv_events_replay)
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
                    if index.apply(seq, _decode(frames[3])) == "gap":
                        return False
                    filled = True
        except (TimeoutError, zmq.ZMQError):
            return False
        finally:
            dealer.close()
        if filled:
            index.replayed()
        return filled

    def __len__(self) -> int:
        return len(self._tasks)
