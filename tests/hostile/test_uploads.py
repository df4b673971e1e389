"""Hostile uploads: multipart bodies that stall, after their ``model`` field (holding an instance
slot while the body streams upstream) or before it (holding only their connection). Both are due
within ``body_timeout``, like any body: a 408, the slot and the connection given back."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest

from tests.hostile.attacks import BOUNDARY, FILE_START, MODEL_FIELD, stalled_upload, swallow
from tests.hostile.helpers import AUTH, MODEL, beside, gateway, head_and_body, in_thread, status_of

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
