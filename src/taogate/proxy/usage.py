"""Reading ``usage`` from an answer without parsing all of it: the SSE tap and the JSON body probe.

The tap costs one substring search per relayed chunk; only events that mention ``"usage"`` are
parsed.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["UsageTap", "usage_counts", "usage_of_body"]

_USAGE = b'"usage"'
_MAX_PENDING = 256 * 1024


class UsageTap:
    """Finds the ``usage`` object in an SSE stream without parsing every event.

    Only chunks that mention ``"usage"`` are parsed; an event split across chunks is held until its
    end arrives (bounded).
    """

    __slots__ = ("_pending", "usage")

    def __init__(self) -> None:
        self._pending = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        # Keep what follows the last event boundary (usually nothing: SSE writes end on one), so an
        # event, or the word "usage" itself, split across chunks is still seen whole.
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        rest = data[end + 2 :] if end >= 0 else data
        self._pending = rest if len(rest) < _MAX_PENDING else b""
        if end < 0 or _USAGE not in data:
            return
        for event in data[:end].split(b"\n\n"):
            if _USAGE not in event:
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._take(line[5:].strip())

    def _take(self, raw: bytes) -> None:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict):
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self.usage = usage


_USAGE_KEY = b'"usage":'


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-stream JSON response, or None.

    Only the usage object is parsed when it can be cut out: the last ``"usage":`` followed by a flat
    object, or one whose only nesting is ``prompt_tokens_details``-style objects (a quote inside a
    JSON string is escaped, so the key cannot appear in generated text). A long answer's text is then
    never decoded just to read three counts; anything else falls back to parsing the whole body."""
    at = body.rfind(_USAGE_KEY)
    if at < 0 and _USAGE not in body:
        return None
    start = at + len(_USAGE_KEY)
    while start < len(body) and body[start] in b" \t\r\n":
        start += 1
    if at >= 0 and body[start : start + 1] == b"{":
        end = body.find(b"}", start)
        while end > 0 and body.count(b"{", start, end) > body.count(b"}", start, end + 1):
            end = body.find(b"}", end + 1)
        if end > 0:
            try:
                usage = orjson.loads(body[start : end + 1])
            except orjson.JSONDecodeError:
                pass
            else:
                if isinstance(usage, dict):
                    return usage
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = obj.get("usage") if isinstance(obj, dict) else None
    return found if isinstance(found, dict) else None


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) from an OpenAI usage object."""
    if usage is None:
        return None, None, 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else 0,
    )
