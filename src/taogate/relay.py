"""Small pieces of the response relay: the stream idle guard and the usage tap.

Both are built to cost next to nothing per relayed chunk: the guard is one float assignment per
chunk plus one timer per idle period, the tap one substring search per chunk.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


class IdleGuard:
    """Cancels the relaying task when no chunk has arrived for ``idle`` seconds.

    The relay calls ``touch()`` per chunk (a float store); a single timer re-arms itself at
    ``last + idle`` instead of being rescheduled on every chunk. Time spent blocked sending to a slow
    client (``sending``) does not count: only the instance's silence does.
    """

    __slots__ = ("_handle", "_idle", "_loop", "_task", "expired", "last", "sending")

    def __init__(self, idle: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "IdleGuard must be created inside a task"
        self._task = task
        self._idle = idle
        self.expired = False
        self.sending = False  # blocked writing to the client: that time is not the instance's
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self.last + idle, self._check)

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        deadline = self.last + self._idle
        if self.sending:
            deadline = self._loop.time() + self._idle
        if self._loop.time() < deadline:
            self._handle = self._loop.call_at(deadline, self._check)
            return
        self._handle = None
        self.expired = True
        self._task.cancel()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


_USAGE = b'"usage"'
_MAX_PENDING = 256 * 1024


class UsageTap:
    """Finds the ``usage`` object in an SSE stream without parsing every event.

    Only chunks that mention ``"usage"`` are parsed; an event split across chunks is held until its
    end arrives (bounded).
    """

    __slots__ = ("_pending", "usage")

    def __init__(self) -> None:
        self._pending = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        # Keep what follows the last event boundary (usually nothing: SSE writes end on one), so an
        # event, or the word "usage" itself, split across chunks is still seen whole.
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        rest = data[end + 2 :] if end >= 0 else data
        self._pending = rest if len(rest) < _MAX_PENDING else b""
        if end < 0 or _USAGE not in data:
            return
        for event in data[:end].split(b"\n\n"):
            if _USAGE not in event:
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._take(line[5:].strip())

    def _take(self, raw: bytes) -> None:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict):
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self.usage = usage


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-stream JSON response, or None."""
    if _USAGE not in body:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) from an OpenAI usage object."""
    if usage is None:
        return None, None, 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else 0,
    )
