"""Relaying an instance's answer to the client: a whole JSON body, or an SSE stream as it arrives.

Once the first byte of a stream has gone to the client nothing can be retried, so every failure
ends the stream the same way: the route's error event, on an event boundary, then the end of the
body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from taogate.errors import OPENAI_ERRORS, ErrorShape
from taogate.proxy.idle import IdleGuard
from taogate.proxy.intake import ClientStalled
from taogate.proxy.upstream import UPSTREAM_ERRORS, UpstreamResponse
from taogate.proxy.usage import UsageTap

__all__ = ["StreamEnd", "relay_sse", "send_whole"]


async def send_whole(
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    on_last_message: Callable[[], None],
) -> None:
    """A complete answer in two ASGI messages (``on_last_message`` just before the body goes)."""
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    on_last_message()
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass(frozen=True, slots=True)
class StreamEnd:
    error: str | None  # None: the instance finished the stream; else a bounded code
    usage: dict[str, Any] | None


async def relay_sse(
    response: UpstreamResponse,
    send: Send,
    *,
    instance: str,
    idle: float,
    stall: float | None = None,
    limit: float | None = None,
    errors: ErrorShape = OPENAI_ERRORS,
    on_first_chunk: Callable[[], None],
    on_last_message: Callable[[], None],
) -> StreamEnd:
    """Relay the body of an already-started SSE response; always sends the final body message,
    unless the client stopped reading for ``stall`` seconds: then ``ClientStalled``. ``idle``
    counts seconds without a complete event; ``limit`` bounds the whole stream."""
    tap = UsageTap()
    guard = IdleGuard(idle, stall, limit)
    first = True
    tail = b"\n\n"
    error: tuple[str, str] | None = None
    try:
        async for chunk in response.aiter_raw():
            if first:
                first = False
                on_first_chunk()
            ended = tap.feed(chunk)
            guard.sending_started()  # a slow client is not a silent instance
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            guard.sent(ended)
            tail = chunk[-2:]
    except asyncio.CancelledError:
        task = asyncio.current_task()
        # The guard's cancel alone means the instance went quiet, the client stopped reading or
        # the stream ran out of time; any other cancel (the client hung up, shutdown) propagates.
        if not (guard.expired or guard.stalled or guard.overdue) or task is None or task.cancelling() > 1:
            raise
        task.uncancel()
        if guard.stalled:
            raise ClientStalled(f"the client read nothing for {stall:g}s") from None
        if guard.overdue:
            error = ("stream_timeout", f"the stream from instance {instance} lasted over {limit:g}s")
        else:
            error = ("stream_idle_timeout", f"no complete event from instance {instance} for {idle:g}s")
    except UPSTREAM_ERRORS as exc:
        error = ("upstream_stream_broken", f"instance {instance} broke the stream ({type(exc).__name__})")
    finally:
        guard.close()
    if error is not None:
        code, message = error
        event = errors.stream_end(message, code)
        if tail != b"\n\n":  # never splice the error into a half-relayed event
            event = b"\n\n" + event
        await send({"type": "http.response.body", "body": event, "more_body": True})
    on_last_message()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return StreamEnd(error[0] if error else None, tap.usage)
