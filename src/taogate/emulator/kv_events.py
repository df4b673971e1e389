"""vLLM's KV-cache events on the wire: ZMQ PUB frames, sequence numbers, and the replay socket.

One engine step that cached or evicted anything becomes one batch, sent as three frames::

    [topic (utf-8), sequence (8 bytes, big-endian, from 0 per start), msgpack [ts, [event, ...], 0]]

each event a map whose first key is ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), as
vLLM's msgspec encoder writes them (plain msgpack over insertion-ordered dicts gives the same bytes).
The PUB socket binds a wildcard, ``::`` or ipc/inproc endpoint and connects to any other, as vLLM's
publisher does (then the subscriber binds). With ``replay`` a ROUTER socket (always bound) answers
``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, ``[b"", topic, seq, payload]``
each, then ``[b"", b"", -1 as 8 signed bytes, b""]``.

``kv_event_frames`` is the pure part: what a conformance test compares with real vLLM's frames.
pyzmq and msgpack are the ``precise`` extra, imported only when events are configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final

from taogate.dispatch.blocks import publisher_binds as binds

__all__ = ["END_SEQ", "KvEventPublisher", "binds", "encode_batch", "kv_event_frames", "offset_endpoint"]

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RuntimeError(f"KV events need the `{name}` package: pip install 'taogate[precise]'") from exc


def encode_batch(ts: float, events: Sequence[Mapping[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one batch: ``[ts as float64, [event maps], rank]``."""
    packed: bytes = _module("msgpack").packb([ts, list(events), data_parallel_rank], use_bin_type=True)
    return packed


def kv_event_frames(topic: str, seq: int, ts: float, events: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The three frames vLLM sends for one batch."""
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(ts, events)]


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """The endpoint of the ``offset``-th instance: its TCP port plus ``offset`` (port 0 and other
    transports are left alone), as vLLM offsets data-parallel ranks."""
    if endpoint is None or not offset or not endpoint.startswith("tcp://"):
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{head}:{int(port) + offset}"


class KvEventPublisher:
    """One instance's publisher; ``publish`` never blocks (PUB drops what nobody subscribed to)."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        zmq = _module("zmq")
        self._zmq = zmq
        self.topic = topic
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
        self._replay_endpoint = replay
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        """Serve the replay socket on the running loop (when configured)."""
        if self._replay_endpoint is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[Mapping[str, Any]], ts: float | None = None) -> None:
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        frames = kv_event_frames(self.topic, seq, time.time() if ts is None else ts, events)
        self._buffer.append((seq, frames[2]))
        with contextlib.suppress(self._zmq.Again):
            self._pub.send_multipart(frames, flags=self._zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        zmq_asyncio = _module("zmq.asyncio")
        context = zmq_asyncio.Context()
        router = context.socket(self._zmq.ROUTER)
        router.setsockopt(self._zmq.LINGER, 0)
        router.bind(self._replay_endpoint)
        topic = self.topic.encode()
        try:
            while True:
                frame = await router.recv_multipart()
                if len(frame) != 3:
                    continue
                client, _, start = frame
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await router.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
                await router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close()
            context.term()

    async def aclose(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close()
        self._context.term()
