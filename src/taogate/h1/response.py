"""One response being received: status and headers first, then the body as it arrives, which its
``Connection`` feeds and pauses (``HIGH_WATER``) while the reader lags behind.

A failure is kept as what to raise (a class and its message) and raised anew for each reader; the
body buffered so far is dropped with it. A raised exception kept here would hold, through its
traceback, the reader's frames and with them this response and its buffers: a reference cycle
only a full collection frees.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Final, Protocol

from .errors import ResponseTooLarge, TransportError

__all__ = ["HIGH_WATER", "Failure", "Feed", "Response"]

HIGH_WATER: Final = 256 * 1024  # buffered body bytes at which reading pauses (until drained)

#: What a failed response raises to each reader: a class and its message, never a raised instance.
Failure = tuple[type[TransportError], str]


class Feed(Protocol):
    """What a response needs from the connection that feeds it."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def paused(self) -> bool: ...

    def resume(self) -> None: ...

    def arm_timer(self) -> None: ...

    def rearm_timer(self) -> None: ...

    def release(self) -> None: ...

    def abort(self) -> None: ...


class Response:
    """One response being received: status and headers first, then the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_failure",
        "_wait_started",
        "_waiter",
        "complete",
        "deadline",
        "headers_done",
        "keep_alive",
        "raw_headers",
        "received",
        "status_code",
    )

    def __init__(self, conn: Feed) -> None:
        self._conn: Feed | None = conn
        self.status_code = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as sent, but names in lower case
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the reply arrived
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._failure: Failure | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._wait_started = 0.0
        self.deadline: float | None = None  # loop time by which the head (then a whole body) is in

    # -- consumer side -------------------------------------------------------------------------
    def header(self, name: str) -> str:
        """The first value of header ``name`` (case-insensitive), or ''."""
        want = name.lower().encode()
        for k, v in self.raw_headers:
            if k == want:
                return v.decode("latin-1")
        return ""

    async def aread(self, limit: int | None = None, within: float | None = None) -> bytes:
        """The whole body: at most ``limit`` bytes (else ``ResponseTooLarge``: the connection is
        aborted, or kept if the body was already all in), all in within ``within`` seconds (else
        ``ReadTimeout``)."""
        if self.complete and self._failure is None:  # all of it is here already (small answers)
            data = self._take()
            self.close()
            if limit is not None and len(data) > limit:
                raise ResponseTooLarge(limit)
            return data
        conn = self._conn
        if within is not None and conn is not None:
            self.deadline = conn.loop.time() + within
            conn.rearm_timer()
        parts: list[bytes] = []
        size = 0
        try:
            while (chunk := await self.next_chunk()) is not None:
                size += len(chunk)
                if limit is not None and size > limit:
                    self.close()
                    raise ResponseTooLarge(limit)
                parts.append(chunk)
        except BaseException:
            parts.clear()  # the exception's traceback holds this frame: not the body with it
            raise
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked), whatever is buffered joined into one piece."""
        return _Chunks(self)

    async def next_chunk(self) -> bytes | None:
        """The body's next piece (whatever is buffered, joined), or None at its end."""
        while True:
            if self._chunks:
                data = self._take()
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                return data
            if self._failure is not None:
                raise self.failure()
            if self.complete:
                self.close()  # read to the end: the connection goes back to the pool at once
                return None
            await self._wait()

    def failure(self) -> TransportError:
        """A new instance of what failed this response (it keeps no raised exception)."""
        assert self._failure is not None
        cls, message = self._failure
        return cls(message)

    def _take(self) -> bytes:
        """Everything buffered, as one piece; the buffer is empty after."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    def close(self) -> None:
        """Done with this response: a connection whose reply was read to its end is reused, any
        other is aborted (for an unfinished reply, that is what tells vLLM to stop)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.complete and self._failure is None and self.keep_alive:
            conn.release()
        else:
            conn.abort()

    # -- producer side (the connection) ---------------------------------------------------------
    async def _wait(self) -> None:
        conn = self._conn
        assert conn is not None, "response already closed"
        loop = conn.loop
        fut = loop.create_future()
        self._waiter = fut
        self._wait_started = loop.time()
        conn.arm_timer()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail(self, kind: type[TransportError], message: str) -> None:
        if self._failure is None and not self.complete:
            self._failure = (kind, message)
            self._chunks.clear()  # nobody will read them
            self._buffered = 0
        self._wake()


class _Chunks:
    """``Response.aiter_raw``: a class rather than an async generator, which mypyc cannot compile."""

    __slots__ = ("_response",)

    def __init__(self, response: Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk
