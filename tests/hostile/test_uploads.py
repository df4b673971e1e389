"""Hostile uploads: multipart bodies that stall, after their ``model`` field (holding an instance
slot while the body streams upstream) or before it (holding only their connection). Both are due
within ``body_timeout``, like any body: a 408, the slot and the connection given back."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest

from tests.hostile.attacks import BOUNDARY, FILE_START, MODEL_FIELD, stalled_upload, swallow
from tests.hostile.helpers import (
    AUTH,
    MODEL,
    answer_json,
    beside,
    gateway,
    head_and_body,
    hostile_request,
    in_thread,
    read_all,
    status_of,
)

pytestmark = pytest.mark.timeout(90)


def _eight(url: str, start: str) -> list[tuple[float, bytes]]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: stalled_upload(url, start, 0.5), range(8)))


@pytest.mark.parametrize(
    "start", [MODEL_FIELD + FILE_START, f"--{BOUNDARY}\r\ncontent-disp"], ids=["after-model", "before-model"]
)
async def test_a_stalled_upload_is_408_within_the_body_timeout_and_frees_its_slot(start: str) -> None:
    sections: dict[str, Any] = {"gateway": {"body_timeout": 1.0}, "dispatch": {"max_queue_per_instance": 4}}
    async with gateway(swallow, **sections) as (gw, scripted), beside(gw):
        results = await in_thread(_eight, gw.url, start)
    for took, answer in results:
        assert took < 3.0, f"held for {took:.1f}s"
        headers, body = head_and_body(answer)
        assert status_of(answer) == 408, answer[:300]
        assert b'"body_timeout"' in body and headers["connection"] == ["close"]
    if start.startswith(MODEL_FIELD):
        assert scripted is not None and len(scripted.heads) == 8  # they did hold slots, for a while


async def test_an_upload_its_key_refuses_before_dispatch_ends_its_connection() -> None:
    """A form refused after its ``model`` field by its key (a model it may not use) while the rest
    of it is still coming: the answer ends the connection, whose unread rest cannot carry a next
    request, at once instead of at the body timeout."""
    digest = hashlib.sha256(b"uploader-secret").hexdigest()
    keys = [{"name": "uploader", "key_sha256": digest, "models": ["another-model"]}]
    async with gateway(swallow, keys=keys, gateway={"body_timeout": 10.0}) as (gw, scripted):  # type: ignore[arg-type]
        took, answer = await in_thread(
            partial(stalled_upload, key="uploader-secret"), gw.url, MODEL_FIELD + FILE_START, 0.25, 40
        )
    headers, body = head_and_body(answer)
    assert status_of(answer) == 404 and b'"model_not_found"' in body, answer[:300]
    assert headers["connection"] == ["close"] and took < 5.0, (headers, took)
    assert scripted is not None and not scripted.heads  # nothing went upstream


async def test_a_compressed_form_is_refused_as_a_compressed_json_body_is() -> None:
    """Its model field cannot be read compressed (it was read as no model at all): a 415, and the
    connection ends at once, the rest of the form unread."""
    gzipped = partial(stalled_upload, extra="content-encoding: gzip\r\n")
    async with gateway(swallow) as (gw, scripted):
        took, answer = await in_thread(gzipped, gw.url, MODEL_FIELD + FILE_START, 0.25, 40)
    headers, body = head_and_body(answer)
    assert status_of(answer) == 415 and b"send the form uncompressed" in body, answer[:300]
    assert headers["connection"] == ["close"] and took < 5.0, (headers, took)
    assert scripted is not None and not scripted.heads


def _form(url: str, boundary: str) -> httpx.Response:
    parts = (
        f'--{boundary}\r\ncontent-disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'
        f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        f"RIFF\r\n--{boundary}--\r\n"
    )
    content_type = f"multipart/form-data; boundary={boundary}"
    with httpx.Client(headers={**AUTH, "content-type": content_type}, timeout=20) as client:
        return client.post(url + "/v1/audio/transcriptions", content=parts.encode())


async def test_a_form_whose_boundary_the_parser_refuses_is_the_instance_s_to_answer() -> None:
    """A boundary over the form parser's 256 bytes was a 500 and a traceback per request; it is
    dispatched without a model read, as any malformed form, and the instance answers."""
    async with gateway() as (gw, _):
        for boundary in ("b" * 70, "b" * 257):
            answer = await in_thread(_form, gw.url, boundary)
            assert answer.status_code != 500 and "x-taogate-instance" in answer.headers, answer.text


def _upload_after(url: str, pause: float) -> bytes:
    """A form sent as a client on a slow link sends it: its head at once, the rest ``pause`` s later."""
    head, rest = MODEL_FIELD + FILE_START, "a" * 1000 + f"\r\n--{BOUNDARY}--\r\n"
    start = (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: {AUTH['authorization']}\r\ncontent-length: {len(head) + len(rest)}\r\n"
        f"content-type: multipart/form-data; boundary={BOUNDARY}\r\nconnection: close\r\n\r\n"
    )
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((start + head).encode())
        time.sleep(pause)
        sock.sendall(rest.encode())
        return read_all(sock)


async def test_an_upload_s_wait_in_the_gateway_queue_is_not_counted_against_its_body_timeout() -> None:
    """The instance's one slot is held for 2 s: the upload waits 1.7 s in the queue, more than its
    1.5 s body timeout, then reads its rest. Only the waits for the client's bytes count (0.8 s)."""

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        if head.startswith(b"POST /v1/completions"):
            time.sleep(2.0)
        sock.sendall(answer_json())

    sections: dict[str, Any] = {"gateway": {"body_timeout": 1.5}, "dispatch": {"max_queue_per_instance": 1}}
    async with gateway(answer, **sections) as (gw, scripted), httpx.AsyncClient(timeout=30) as http:
        held = http.post(gw.url + "/v1/completions", json=hostile_request(), headers=AUTH)
        holder = asyncio.create_task(held)
        await asyncio.sleep(0.3)
        uploaded = await in_thread(_upload_after, gw.url, 2.5)
        assert (await holder).status_code == 200
    assert status_of(uploaded) == 200, uploaded[:300]
    assert scripted is not None and len(scripted.heads) == 2
