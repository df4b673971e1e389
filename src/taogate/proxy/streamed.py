"""The hop for request bodies streamed as they arrive (multipart uploads), on httpx.

``h1`` sends bodies the gateway already holds; an upload is sent while it is still arriving, which
httpx does with flow control. Uploads are rare and large, so this path is measured by what it does
not hold (the file), not by its CPU per request. Its answers look like ``h1.Response`` to the relay,
and its failures are the same httpx exception classes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from taogate.proxy.multipart import StreamedBody
from taogate.settings import GatewaySettings

__all__ = ["StreamedResponse", "StreamedUploads"]

#: Closing an answer read only in part is a coroutine; the tasks doing it are kept till they end.
_closing: set[asyncio.Task[None]] = set()


class StreamedResponse:
    """An httpx response with the face of ``h1.Response``."""

    __slots__ = ("_response", "raw_headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.raw_headers: list[tuple[bytes, bytes]] = list(response.headers.raw)

    def header(self, name: str) -> str:
        return str(self._response.headers.get(name, ""))

    async def aread(self, *_: Any) -> bytes:
        return await self._response.aread()

    def aiter_raw(self) -> Any:
        return self._response.aiter_raw()

    def close(self) -> None:
        task = asyncio.get_running_loop().create_task(self._response.aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)


class StreamedUploads:
    """A small httpx client of its own, created on the first upload."""

    def __init__(self, cfg: GatewaySettings) -> None:
        self._cfg = cfg
        self._client: httpx.AsyncClient | None = None

    def configure(self, cfg: GatewaySettings) -> None:
        self._cfg = cfg
        if self._client is not None:
            self._client.timeout = self._timeout()

    def _timeout(self) -> httpx.Timeout:
        cfg = self._cfg
        return httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)

    async def send(
        self, base_url: str, path: bytes, headers: list[tuple[bytes, bytes]], body: StreamedBody
    ) -> StreamedResponse:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout(), trust_env=False)
        request = self._client.build_request(
            "POST", base_url + path.decode("latin-1"), headers=headers, content=body
        )
        return StreamedResponse(await self._client.send(request, stream=True))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
