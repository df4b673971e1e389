"""Relaying an instance's answer to the client: a whole JSON body, or an SSE stream as it arrives.

Once the first byte of a stream has gone to the client nothing can be retried, so every failure
ends the stream the same way: the route's error event, then the end of the body. Only whole events
are relayed: the unfinished end of a chunk waits for the rest of its event, so a stream cut in the
middle of one drops the fragment, and the client's SDK reads an error event, never half a JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson
from starlette.types import Send

from taogate.errors import OPENAI_ERRORS, ErrorShape
from taogate.proxy.idle import IdleGuard
from taogate.proxy.intake import ClientStalled
from taogate.proxy.upstream import UPSTREAM_ERRORS
from taogate.proxy.usage import UsageTap, spans_with

__all__ = [
    "MAX_EVENT_BYTES",
    "SEND_BYTES",
    "EventTooLarge",
    "Events",
    "StreamEnd",
    "piece_end",
    "relay_sse",
    "without_usage_only",
]


#: The most an unfinished event may hold before the stream is ended (vLLM's largest, a Responses
#: ``response.completed`` carrying the whole output, is a small fraction of it).
MAX_EVENT_BYTES: Final = 8 << 20
#: Relayed in one send at most (cut at an event's end): what a slow client must take within the
#: stall limit, whatever the instance sent in one burst.
SEND_BYTES: Final = 64 * 1024
#: The last event of a stream (vLLM's Chat, Completions and Messages streams end so), LF or CRLF:
#: an instance silent after it has finished.
_DONE: Final = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n")


class Events:
    """Cuts relayed chunks on event boundaries (a blank line, LF or CRLF): ``whole`` returns what
    of a chunk completes events, and holds the rest (at most ``limit`` bytes) for the next one.
    The usual chunk (whole events) passes through untouched; held bytes are joined once."""

    __slots__ = ("_held", "_limit", "_size", "_tail")

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._held: list[bytes] = []
        self._size = 0
        self._tail = b""  # the held bytes' last two, for a blank line across the cut
        self._limit = limit

    @property
    def held(self) -> int:
        """Bytes of an unfinished event waiting for its end."""
        return self._size

    def whole(self, chunk: bytes) -> bytes:
        held = self._held
        if not held and chunk.endswith(b"\n\n"):  # the usual case
            return chunk
        tail = self._tail
        edge = tail + chunk
        lf, crlf = edge.rfind(b"\n\n"), edge.rfind(b"\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0) - len(tail)
        if end <= 0:  # no boundary in this chunk: all of it waits
            self._size += len(chunk)
            if self._size > self._limit:
                raise EventTooLarge(self._limit)
            held.append(chunk)
            self._tail = edge[-2:]
            return b""
        out = b"".join([*held, chunk[:end]]) if held else chunk[:end]
        rest = chunk[end:]
        held.clear()
        if rest:
            held.append(rest)
        self._size = len(rest)
        self._tail = rest[-2:]
        return out


class EventTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"an event over {limit} bytes")
        self.limit = limit


class Chunks(Protocol):
    """What the relay reads of an instance's answer (``h1.Response``): its body as it arrives."""

    def aiter_raw(self) -> AsyncIterator[bytes]: ...


@dataclass(frozen=True, slots=True)
class StreamEnd:
    error: str | None  # None: the instance finished the stream; else a bounded code
    usage: dict[str, Any] | None


def without_usage_only(data: bytes) -> bytes:
    """``data`` (whole events) without its usage-only chunk (``"choices": []`` and a ``usage``), the
    one a stream's ``include_usage`` adds at its end."""
    for start, stop in spans_with(data, b'"usage"'):
        if _usage_only(data[start:stop]):
            return data[:start] + data[stop + 2 :]
    return data


def _usage_only(event: bytes) -> bool:
    data = b"".join(line[5:] for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and chunk.get("usage") is not None


def piece_end(data: bytes, start: int) -> int:
    """Where the piece of ``data`` from ``start`` ends: the last event end within ``SEND_BYTES``,
    else the first after (an event is never split); ``len(data)`` if there is none."""
    stop = start + SEND_BYTES
    lf, crlf = data.rfind(b"\n\n", start, stop), data.rfind(b"\n\r\n", start, stop)
    if lf >= 0 or crlf >= 0:
        return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    ends = [i + n for i, n in ((data.find(b"\n\n", stop), 2), (data.find(b"\n\r\n", stop), 3)) if i >= 0]
    return min(ends) if ends else len(data)


async def _send_in_pieces(send: Send, guard: IdleGuard, data: bytes) -> bytes:
    """Sends all of ``data`` but its last piece in pieces of about ``SEND_BYTES``, each timed by
    the guard on its own; returns the last piece."""
    start = 0
    while len(data) - start > SEND_BYTES:
        end = piece_end(data, start)
        if end >= len(data):
            break
        await send({"type": "http.response.body", "body": data[start:end], "more_body": True})
        guard.sent(False)
        guard.sending_started()
        start = end
    return data[start:]


async def relay_sse(
    response: Chunks,
    send: Send,
    *,
    instance: str,
    idle: float,
    stall: float | None = None,
    limit: float | None = None,
    max_event: int = MAX_EVENT_BYTES,
    errors: ErrorShape = OPENAI_ERRORS,
    on_first_chunk: Callable[[], None],
    on_last_message: Callable[[], None],
    hide_usage: bool = False,
) -> StreamEnd:
    """Relay the body of an already-started SSE response; always sends the final body message,
    unless the client stopped reading for ``stall`` seconds: then ``ClientStalled``. ``idle``
    counts seconds without a complete event; ``limit`` bounds the whole stream, ``max_event`` the
    bytes of one event (held until its end); ``hide_usage``: the usage-only chunk is read, not
    relayed (the gateway asked for it)."""
    tap = UsageTap()
    guard = IdleGuard(idle, stall, limit)
    try:
        events = Events(max_event)
        error = await _relay(response, send, guard, tap, events, instance, on_first_chunk, hide_usage)
        await _finish(send, guard, errors, error, on_last_message)
    finally:
        guard.close()
    return StreamEnd(error[0] if error else None, tap.usage)


def _stalled(guard: IdleGuard) -> ClientStalled:
    return ClientStalled(f"the client read nothing for {guard.stall:g}s")


async def _relay(  # noqa: PLR0917 (relay_sse's own parts)
    response: Chunks,
    send: Send,
    guard: IdleGuard,
    tap: UsageTap,
    events: Events,
    instance: str,
    on_first_chunk: Callable[[], None],
    hide_usage: bool,
) -> tuple[str, str] | None:
    """The stream's events as they come, in whole events; the error that ended it, if any."""
    first = True
    done = False  # the last event relayed was ``[DONE]``
    try:
        async for chunk in response.aiter_raw():
            if first:
                first = False
                on_first_chunk()
            ended = tap.feed(chunk)
            whole = events.whole(chunk)
            if hide_usage and tap.usage is not None:  # the events that brought it are all in ``whole``
                hide_usage = False
                whole = without_usage_only(whole)
            if not whole:
                continue
            guard.sending_started()  # a slow client is not a silent instance
            if len(whole) > SEND_BYTES:
                whole = await _send_in_pieces(send, guard, whole)
            await send({"type": "http.response.body", "body": whole, "more_body": True})
            guard.sent(ended)
            done = whole.endswith(_DONE)
        if events.held:
            return ("upstream_stream_broken", f"instance {instance} ended the stream inside an event")
    except EventTooLarge as big:
        return ("upstream_event_too_large", f"instance {instance} sent an event over {big.limit} bytes")
    except asyncio.CancelledError:
        task = asyncio.current_task()
        # The guard's cancel alone means the instance went quiet, the client stopped reading or
        # the stream ran out of time; any other cancel (the client hung up, shutdown) propagates.
        if not (guard.expired or guard.stalled or guard.overdue) or task is None or task.cancelling() > 1:
            raise
        task.uncancel()
        if guard.stalled:
            raise _stalled(guard) from None
        if guard.overdue:
            return ("stream_timeout", f"the stream from instance {instance} lasted over {guard.limit:g}s")
        if not done:  # silent after [DONE] is finished, whatever keeps its connection open
            return ("stream_idle_timeout", f"no complete event from instance {instance} for {guard.idle:g}s")
    except UPSTREAM_ERRORS as exc:
        return ("upstream_stream_broken", f"instance {instance} broke the stream ({type(exc).__name__})")
    return None


async def _finish(
    send: Send,
    guard: IdleGuard,
    errors: ErrorShape,
    error: tuple[str, str] | None,
    on_last_message: Callable[[], None],
) -> None:
    """The stream's end (its error event, if any, then the body's end), still under the guard: a
    client that stops reading here is stalled as anywhere else, not a stream that ended well."""
    guard.finishing()
    try:
        if error is not None:
            code, message = error  # what went to the client ended on an event boundary
            guard.sending_started()
            await send(
                {"type": "http.response.body", "body": errors.stream_end(message, code), "more_body": True}
            )
            guard.sent()
        on_last_message()
        guard.sending_started()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not guard.stalled or task is None or task.cancelling() > 1:
            raise
        task.uncancel()
        raise _stalled(guard) from None
