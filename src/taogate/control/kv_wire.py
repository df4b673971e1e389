"""vLLM's KV-event batches as read off ZMQ: decoded within bounds, on sockets that bound them.

A batch is ``[topic, seq, msgpack [ts, events, rank]]``, one engine step's events. Anyone who reaches
a bound SUB socket can publish into it, so frames and msgpack containers are bounded.
pyzmq and msgpack are the ``precise`` extra: imported only when an instance has ``kv_events``.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

__all__ = ["MAX_FRAME", "RECEIVE_HWM", "bounded", "decode"]

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


def decode(payload: bytes) -> tuple[float | None, list[Any]]:
    """(ts, events) of one batch; ValueError (or msgpack's own errors) when it is not one."""
    msgpack = importlib.import_module("msgpack")
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, **_UNPACK_LIMITS)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch [ts, events, rank]")
    ts = batch[0]
    return (float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None), batch[1]


def bounded(zmq: Any, sock: Any, hwm: int = RECEIVE_HWM) -> Any:
    """``sock`` closing at once, refusing frames past ``MAX_FRAME``, queueing ``hwm`` at most."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock
