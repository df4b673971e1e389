"""An instance that records what it was sent and answers JSON: for checking what the gateway
forwards (paths, headers, bodies as they arrived)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    chunks: int


@dataclass
class Upstream:
    """An instance serving one model on every route: it answers what it was sent."""

    model: str
    seen: list[Seen] = field(default_factory=list)
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message.get("body"):
                chunks.append(message["body"])
                self.first_chunk.set()
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/models":
            body: dict[str, Any] = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        elif scope["method"] == "GET":  # health probes
            body = {}
        else:
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.seen.append(Seen(scope["method"], path, headers, b"".join(chunks), len(chunks)))
            body = (
                {"text": "transcribed"}
                if path.startswith("/v1/audio/")
                else {"model": self.model, "path": path}
            )
        data = orjson.dumps(body)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})
