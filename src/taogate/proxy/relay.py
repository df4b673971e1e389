"""Small pieces of the response relay: the stream idle guard and the usage tap.

Both are built to cost next to nothing per relayed chunk: the guard is one float assignment per
chunk plus one timer per idle period, the tap one substring search per chunk.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


class IdleGuard:
    """Ends a stream that stopped moving: cancels the relaying task when the instance has sent
    nothing for ``idle`` seconds (``expired``), or when one send to the client has been blocked for
    ``stall`` seconds (``stalled``: a client that keeps its connection open but reads nothing would
    otherwise hold its instance slot for ever).

    The relay calls ``sending_started()`` / ``sent()`` around each chunk (a clock read each); a
    single timer re-arms itself instead of being rescheduled per chunk. Time spent blocked sending
    does not count as the instance's silence.
    """

    __slots__ = ("_handle", "_idle", "_loop", "_stall", "_task", "expired", "last", "send_started", "stalled")

    def __init__(self, idle: float, stall: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "IdleGuard must be created inside a task"
        self._task = task
        self._idle = idle
        self._stall = stall
        self.expired = False
        self.stalled = False
        self.send_started: float | None = None  # set while blocked writing to the client
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._next(self.last), self._check)

    def _next(self, now: float) -> float:
        started = self.send_started
        if started is not None:  # blocked on the client: only the stall limit applies
            return started + self._stall if self._stall is not None else now + self._idle
        deadline = self.last + self._idle
        if self._stall is not None:  # a send may block before the next check
            deadline = min(deadline, now + self._stall)
        return deadline

    def sending_started(self) -> None:
        self.send_started = self._loop.time()

    def sent(self) -> None:
        self.send_started = None
        self.last = self._loop.time()

    def _check(self) -> None:
        now = self._loop.time()
        started = self.send_started
        if started is not None and self._stall is not None and now - started >= self._stall:
            self._handle = None
            self.stalled = True
            self._task.cancel()
            return
        if started is None and now >= self.last + self._idle:
            self._handle = None
            self.expired = True
            self._task.cancel()
            return
        self._handle = self._loop.call_at(max(self._next(now), now + 1e-3), self._check)

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


_USAGE_KEY = b'"usage":'


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-stream JSON response, or None.

    Only the usage object is parsed when it can be cut out: the last ``"usage":`` followed by a flat
    object, or one whose only nesting is ``prompt_tokens_details``-style objects (a quote inside a
    JSON string is escaped, so the key cannot appear in generated text). A long answer's text is then
    never decoded just to read three counts; anything else falls back to parsing the whole body."""
    at = body.rfind(_USAGE_KEY)
    if at < 0 and _USAGE not in body:
        return None
    start = at + len(_USAGE_KEY)
    while start < len(body) and body[start] in b" \t\r\n":
        start += 1
    if at >= 0 and body[start : start + 1] == b"{":
        end = body.find(b"}", start)
        while end > 0 and body.count(b"{", start, end) > body.count(b"}", start, end + 1):
            end = body.find(b"}", end + 1)
        if end > 0:
            try:
                usage = orjson.loads(body[start : end + 1])
            except orjson.JSONDecodeError:
                pass
            else:
                if isinstance(usage, dict):
                    return usage
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = obj.get("usage") if isinstance(obj, dict) else None
    return found if isinstance(found, dict) else None


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
