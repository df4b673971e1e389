"""Multipart uploads (the audio routes): streamed upstream as they arrive, never held whole.

Only the head of the form is read before dispatch, to find its ``model`` field: the OpenAI SDK
writes the data fields before the file, so ``model`` is usually there within the first few hundred
bytes. Reading stops at the first file part (or after ``HEAD_LIMIT`` bytes); a form whose ``model``
comes after its file is dispatched without one, as vLLM then serves its default model.

The gateway waits at most ``body_timeout`` in all for the client's bytes, whoever reads them (the
form's head before dispatch, the upload to the instance after), so a stalled client holds no slot
for longer. Only those waits count: not the time the request spent in the gateway queue, nor the
instance's own pace in taking the upload.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive

from taogate.errors import BodyTooLarge, RequestTimeout

__all__ = ["HEAD_LIMIT", "ClientLeft", "FormHead", "StreamedBody", "late"]

HEAD_LIMIT: Final = 64 * 1024


class ClientLeft(Exception):
    """The client went away while its body was being streamed (the pipeline's ``ClientGone``)."""


class FormHead:
    """Feeds a form's bytes to a streaming parser until the ``model`` field or a file is met."""

    def __init__(self, boundary: bytes) -> None:
        self.model: str | None = None
        self.done = False
        self._field = b""
        self._value = b""
        self._name: bytes | None = None
        self._file = False
        self._data: bytearray | None = None
        self._parser = MultipartParser(
            boundary,
            {
                "on_header_field": self._on_field,
                "on_header_value": self._on_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_data,
                "on_part_end": self._on_part_end,
                "on_end": self._on_end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        if not self.done:
            try:
                self._parser.write(chunk)
            except Exception:  # a malformed form is the instance's to refuse; dispatch without a model
                self.done = True

    def _on_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _on_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _on_header_end(self) -> None:
        if self._field.lower() == b"content-disposition":
            _, options = parse_options_header(self._value)
            self._name = options.get(b"name")
            self._file = b"filename" in options
        self._field = self._value = b""

    def _on_headers_finished(self) -> None:
        if self.done:  # the parser goes on through the rest of the chunk it was given
            return
        if self._file:
            self.done = True  # the file begins: the fields before it are all there is to read
        elif self._name == b"model":
            self._data = bytearray()

    def _on_data(self, data: bytes, start: int, end: int) -> None:
        if self._data is not None:
            self._data += data[start:end]

    def _on_part_end(self) -> None:
        if self._data is not None:
            self.model = self._data.decode("utf-8", "replace").strip() or None
            self.done = True
        self._name, self._file, self._data = None, False, None

    def _on_end(self) -> None:
        self.done = True


def _boundary(content_type: bytes | None) -> bytes | None:
    if content_type is None:
        return None
    kind, options = parse_options_header(content_type)
    return options.get(b"boundary") if kind == b"multipart/form-data" else None


def _form_head(boundary: bytes | None) -> FormHead | None:
    """The parser of a form's head; None without a boundary, or with one the parser refuses (over
    its 256 bytes): a malformed form is the instance's to refuse, dispatched without a model."""
    if not boundary:
        return None
    try:
        return FormHead(boundary)
    except Exception:
        return None


def too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"Request body exceeds {limit} bytes ([gateway] max_body_bytes).")


def late(within: float) -> RequestTimeout:
    return RequestTimeout(f"The request body was not received within {within:g}s ([gateway] body_timeout).")


class StreamedBody:
    """A request body sent upstream as it arrives: the head read before dispatch, then the rest.

    ``started`` once an attempt began sending it (another attempt cannot send it again);
    ``done`` once the client's last byte has been read. Its reads may wait ``within`` seconds in
    all for the client: past that, ``RequestTimeout``."""

    def __init__(self, receive: Receive, limit: int, within: float) -> None:
        self._receive = receive
        self._limit = limit
        self._within = within
        self._left = within  # of the seconds the reads may still wait for the client
        self._loop = asyncio.get_running_loop()
        self._size = 0
        self._head: list[bytes] = []
        self.started = False
        self.done = False

    async def _read(self) -> bytes:
        started = self._loop.time()
        try:
            async with asyncio.timeout(self._left):
                message = await self._receive()
        except TimeoutError:
            raise late(self._within) from None
        finally:
            self._left -= self._loop.time() - started
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk: bytes = message.get("body", b"")
        self._size += len(chunk)
        if self._size > self._limit:
            raise too_large(self._limit)
        self.done = not message.get("more_body", False)
        return chunk

    async def read_model(self, content_type: bytes | None) -> str | None:
        """Read the form's head; its ``model`` field if it comes before the first file."""
        form = _form_head(_boundary(content_type))
        while not self.done and self._size < HEAD_LIMIT:
            chunk = await self._read()
            self._head.append(chunk)
            if form is None:
                break
            form.feed(chunk)
            if form.done:
                break
        return form.model if form is not None else None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        self.started = True
        for chunk in self._head:
            yield chunk
        while not self.done:
            chunk = await self._read()
            if chunk:
                yield chunk
