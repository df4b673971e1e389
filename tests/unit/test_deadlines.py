"""Many deadlines on one timer: an expired wait is told apart from any other cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from taogate.errors import RequestTimeout
from taogate.proxy.deadlines import Deadlines
from taogate.proxy.intake import read_body


async def never() -> dict[str, Any]:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def test_a_body_not_in_by_its_deadline_is_a_request_timeout() -> None:
    deadlines = Deadlines(every=0.01)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RequestTimeout, match=r"within 0\.05s"):
        await read_body(never, 1 << 20, None, 0.05, deadlines)
    assert 0.05 <= loop.time() - started < 1.0
    assert deadlines._due == {} and deadlines._expired == set()


async def test_another_cancellation_is_not_mistaken_for_the_deadline() -> None:
    deadlines = Deadlines(every=0.01)
    task = asyncio.ensure_future(read_body(never, 1 << 20, None, 60.0, deadlines))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert deadlines._due == {}


async def test_bodies_in_on_time_leave_nothing_behind() -> None:
    deadlines = Deadlines(every=0.01)

    async def whole() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    for _ in range(100):
        assert await read_body(whole, 1 << 20, b"2", 0.05, deadlines) == b"{}"
    await asyncio.sleep(0.1)
    assert deadlines._due == {} and deadlines._timer is None
