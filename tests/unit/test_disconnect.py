"""The disconnect watcher: one timer for every request in flight, a request listened to only once it
has lasted ``after``, its task cancelled when its client leaves, nothing kept once it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from taogate.proxy.disconnect import DisconnectWatcher

AFTER = 0.02


async def until(condition: Any, within: float = 5.0) -> None:
    """Wait for ``condition()``: ticks may come late on a loaded machine, never early."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "not within the wait"
        await asyncio.sleep(AFTER / 4)


class Request:
    """What the watch asks of a request, set by the test."""

    def __init__(self, *, reading: bool = False) -> None:
        self.finished = False
        self.reading = reading


class Client:
    """``receive()``: counts its calls and answers ``http.disconnect`` once ``leave()`` is called."""

    def __init__(self) -> None:
        self.calls = 0
        self._gone = asyncio.Event()

    def leave(self) -> None:
        self._gone.set()

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        await self._gone.wait()
        return {"type": "http.disconnect"}


async def test_a_request_shorter_than_after_is_never_listened_to_and_leaves_nothing() -> None:
    watcher = DisconnectWatcher(AFTER)
    client = Client()
    for _ in range(50):
        watch = watcher.watch(Request(), client.receive)
        watch.stop()
    assert watcher.pending == 0
    await asyncio.sleep(AFTER * 4)
    assert client.calls == 0


async def test_a_client_that_leaves_a_long_request_cancels_its_task() -> None:
    watcher = DisconnectWatcher(AFTER)
    client = Client()

    async def serve() -> bool:
        watch = watcher.watch(Request(), client.receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return watch.left()
        finally:
            watch.stop()
        return False

    task = asyncio.create_task(serve())
    await asyncio.sleep(AFTER)
    assert client.calls == 0  # not before it lasted `after`
    await until(lambda: client.calls == 1)
    client.leave()
    assert await asyncio.wait_for(task, 5) is True
    assert watcher.pending == 0


async def test_a_cancellation_not_the_clients_is_not_a_hang_up() -> None:
    watcher = DisconnectWatcher(AFTER)
    client = Client()
    started = asyncio.Event()
    seen: list[bool] = []

    async def serve() -> None:
        watch = watcher.watch(Request(), client.receive)
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(watch.left())
            raise
        finally:
            watch.stop()

    task = asyncio.create_task(serve())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False] and watcher.pending == 0


async def test_a_streamed_body_keeps_receive_until_its_end() -> None:
    watcher = DisconnectWatcher(AFTER)
    client = Client()
    request = Request(reading=True)
    watch = watcher.watch(request, client.receive)
    await asyncio.sleep(AFTER * 4)
    assert client.calls == 0 and watcher.pending == 1
    request.reading = False
    await until(lambda: client.calls == 1)
    assert watcher.pending == 0
    watch.stop()


async def test_a_disconnect_after_the_last_message_is_not_a_hang_up() -> None:
    watcher = DisconnectWatcher(AFTER)
    client = Client()
    request = Request()

    async def serve() -> None:
        watch = watcher.watch(request, client.receive)
        try:
            await until(lambda: client.calls == 1)
            request.finished = True
            client.leave()  # uvicorn answers receive() so once the response is complete
            await asyncio.sleep(AFTER)
        finally:
            watch.stop()

    await asyncio.wait_for(serve(), 5)  # not cancelled
