"""Hostile uploads: multipart bodies that stall, after their ``model`` field (holding an instance
slot while the body streams upstream) or before it (holding only their connection). Both are due
within ``body_timeout``, like any body: a 408, the slot and the connection given back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.hostile.helpers import (
    HOSTILE,
    beside,
    connect,
    gateway,
    head_and_body,
    in_thread,
    post_head,
    read_all,
    status_of,
    trickle,
)

pytestmark = pytest.mark.timeout(90)

BOUNDARY = "hostileboundary"
MODEL_FIELD = f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="model"\r\n\r\n{HOSTILE}\r\n'
FILE_START = (
    f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n'
    "content-type: audio/wav\r\n\r\nRIFF"
)


def _stalled_upload(gw: Any, start: str, pause: float) -> tuple[float, bytes]:
    """A form head declaring a megabyte, then a byte every ``pause`` s (for at most 20 bytes):
    how long until the gateway answered or hung up, and what it said."""
    head = post_head(
        "/v1/audio/transcriptions", 1_000_000, f"content-type: multipart/form-data; boundary={BOUNDARY}"
    ).replace(b"content-type: application/json\r\n", b"")
    with connect(gw, timeout=30) as sock:
        t = time.perf_counter()
        sock.sendall(head + start.encode())
        trickle(sock, b"a" * 20, 1, pause)
        took = time.perf_counter() - t
        return took, read_all(sock)


def _eight(gw: Any, start: str) -> list[tuple[float, bytes]]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: _stalled_upload(gw, start, 0.5), range(8)))


@pytest.mark.parametrize(
    "start", [MODEL_FIELD + FILE_START, f"--{BOUNDARY}\r\ncontent-disp"], ids=["after-model", "before-model"]
)
async def test_a_stalled_upload_is_408_within_the_body_timeout_and_frees_its_slot(start: str) -> None:
    sections: dict[str, Any] = {"gateway": {"body_timeout": 1.0}, "dispatch": {"max_queue_per_instance": 4}}
    async with gateway(lambda *_: None, **sections) as (gw, scripted), beside(gw):
        results = await in_thread(_eight, gw, start)
    for took, answer in results:
        assert took < 3.0, f"held for {took:.1f}s"
        headers, body = head_and_body(answer)
        assert status_of(answer) == 408, answer[:300]
        assert b'"body_timeout"' in body and headers["connection"] == ["close"]
    if start.startswith(MODEL_FIELD):
        assert scripted is not None and len(scripted.heads) == 8  # they did hold slots, for a while
