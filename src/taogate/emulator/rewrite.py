"""An ASGI ``send`` that rewrites a chat completion's answer into another API's as it is sent: vLLM
serves the Messages and Responses APIs over its chat completions, and so does the emulator.

A stream is rewritten body message by body message (the emulator writes whole SSE events); a
whole answer is held until its end and sent with its new length, an error status included."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import Message, Send

from taogate.emulator.asgi import send_bytes

__all__ = ["Rewrite"]


class Rewrite(ABC):
    """Subclasses say what a stream's chat events, a whole chat answer and an error become."""

    def __init__(self, send: Send, stream: bool) -> None:
        self._send = send
        self._stream = stream
        self._status = 200
        self._headers: list[tuple[bytes, bytes]] = []
        self._held: list[bytes] = []

    @abstractmethod
    def events(self, body: bytes) -> list[bytes]:
        """A stream's body message of chat SSE events, as the other API's events."""

    @abstractmethod
    def whole(self, body: bytes) -> bytes:
        """A whole chat answer, as the other API's."""

    def error(self, status: int, body: bytes) -> bytes:
        return body

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            # The rewritten body gets its own length and content type (send_bytes writes both).
            drop = (b"content-length", b"content-type")
            self._headers = [(k, v) for k, v in message.get("headers", []) if k not in drop]
            if self._status == 200 and self._stream:
                await self._send(message)
            return
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self._status == 200 and self._stream:
            out = b"".join(self.events(body))
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._held.append(body)
        if more:
            return
        whole = b"".join(self._held)
        data = self.whole(whole) if self._status == 200 else self.error(self._status, whole)
        await send_bytes(self._send, self._status, data, headers=self._headers)
