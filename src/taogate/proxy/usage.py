"""Reading ``usage`` from an answer without parsing all of it: the SSE tap and the JSON body probe.

The tap costs a substring search or two per relayed chunk; only events that mention ``"usage"`` are
parsed. Both are linear in the answer, whatever its shape: every byte is copied a few times at most
(twice, or four times within an event past the tap's bound), and the probe never rescans what it
has scanned.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

__all__ = ["UsageTap", "counts", "spans_with", "usage_counts", "usage_of_body"]

_USAGE = b'"usage"'
_MAX_PENDING = 256 * 1024
#: What is kept of a bigger event: its end, which holds a Responses answer's usage.
_KEPT_END = 64 * 1024


class UsageTap:
    """Finds the ``usage`` object in an SSE stream without parsing every event, and says which
    chunks end an event (the relay's idle rule counts events, not bytes).

    Only chunks that mention ``"usage"`` are parsed; an event split across chunks is held until its
    end arrives. Held within a bound: of a bigger event (a Responses answer echoed whole in
    ``response.completed``) only the end is kept, where its usage is, and cut out at its end.
    """

    __slots__ = ("_cut", "_parts", "_size", "_tail", "usage")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # the unfinished event so far
        self._size = 0
        self._cut = False  # the unfinished event's start was dropped: only its end is held
        self._tail = b""  # the last two bytes seen, for a blank line split across chunks
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bool:
        """Take the next chunk; whether an event ended in it (a blank line, LF or CRLF)."""
        if not self._parts and chunk.endswith(b"\n\n"):  # the usual case: whole events
            self._tail = b"\n\n"
            if _USAGE in chunk:
                self._scan(chunk, len(chunk) - 2)
            return True
        tail = self._tail
        if chunk.endswith(b"\n\n"):
            split = ended = True
        else:
            edge = tail + chunk[:2]  # a blank line whose last byte is this chunk's first or second
            split = b"\n\n" in chunk or edge.find(b"\n\n", max(0, len(tail) - 1)) >= 0
            ended = split or b"\n\r\n" in chunk or edge.find(b"\n\r\n", max(0, len(tail) - 2)) >= 0
        self._tail = chunk[-2:] if len(chunk) >= 2 else (tail + chunk)[-2:]
        parts = self._parts
        if ended and not split:  # an event ended by CRLF (rare: vLLM's are LF): read it as LF
            parts.append(chunk)
            data = b"".join(parts).replace(b"\r\n", b"\n")
            parts.clear()
            self._size = 0
        elif parts:
            if not split:
                parts.append(chunk)
                self._size += len(chunk)
                if self._size > _MAX_PENDING:
                    kept = b"".join(parts)[-_KEPT_END:]
                    parts[:] = [kept]
                    self._size, self._cut = len(kept), True
                return ended
            parts.append(chunk)
            data = b"".join(parts)
            parts.clear()
            self._size = 0
        else:
            data = chunk
        if self._cut:  # the big event's end is the first boundary in ``data``
            self._cut = False
            first = data.find(b"\n\n")
            at = data.rfind(_USAGE_KEY, 0, first)
            usage = _cut_out(data, at + len(_USAGE_KEY)) if at >= 0 else None
            if usage is not None:
                self.usage = usage
            data = data[first + 2 :]
        # Keep what follows the last event boundary (usually nothing), so an event, or the word
        # "usage" itself, split across chunks is still seen whole.
        end = data.rfind(b"\n\n")
        rest = data[end + 2 :] if end >= 0 else data
        if rest and len(rest) < _MAX_PENDING:
            parts.append(rest)
            self._size = len(rest)
        if end >= 0 and _USAGE in data:
            self._scan(data, end)
        return ended

    def _scan(self, data: bytes, end: int) -> None:
        """The last usage in the whole events of ``data[:end]``."""
        for start, stop in spans_with(data, _USAGE, end):
            for line in data[start:stop].split(b"\n"):
                if line.startswith(b"data:") and self._take(line[5:].strip()):
                    return

    def _take(self, raw: bytes) -> bool:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return False
        if isinstance(obj, dict):
            usage = obj.get("usage")
            if usage is None and isinstance(obj.get("response"), dict):  # Responses: response.completed
                usage = obj["response"].get("usage")
            if isinstance(usage, dict):
                self.usage = usage
                return True
        return False


def spans_with(data: bytes, needle: bytes, end: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, stop) of each event of ``data[:end]`` (LF-framed, the blank line left out) that holds
    ``needle``, the last first: each found by a search back, no event split that does not hold it."""
    limit = len(data) if end is None else end
    at = data.rfind(needle, 0, limit)
    while at >= 0:
        before = data.rfind(b"\n\n", 0, at)
        start = before + 2 if before >= 0 else 0
        stop = data.find(b"\n\n", at, limit)
        yield start, stop if stop >= 0 else limit
        at = data.rfind(needle, 0, start)


_USAGE_KEY = b'"usage":'
#: vLLM's usage object is a few hundred bytes with one or two nested objects; past these it is not
#: cut out, and a body past ``_MAX_FULL_PARSE`` is not parsed whole just to read three counts.
_MAX_USAGE_BYTES = 4096
_MAX_NESTED = 16
_MAX_FULL_PARSE = 1 << 20


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-stream JSON response, or None.

    Only the usage object is parsed when it can be cut out: the last ``"usage":`` followed by a
    small object (a quote inside a JSON string is escaped, so the key cannot appear in generated
    text). A long answer's text is then never decoded just to read three counts; otherwise a body
    of moderate size is parsed whole, and a larger one is given up on."""
    at = body.rfind(_USAGE_KEY)
    if at < 0 and _USAGE not in body:
        return None
    if at >= 0:
        usage = _cut_out(body, at + len(_USAGE_KEY))
        if usage is not None:
            return usage
    if len(body) > _MAX_FULL_PARSE:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = obj.get("usage") if isinstance(obj, dict) else None
    return found if isinstance(found, dict) else None


def _cut_out(body: bytes, start: int) -> dict[str, Any] | None:
    """The object starting at ``start`` (after blanks), when it is small; each brace found once."""
    while start < len(body) and body[start] in b" \t\r\n":
        start += 1
    if body[start : start + 1] != b"{":
        return None
    stop = min(len(body), start + _MAX_USAGE_BYTES)
    depth = 1
    at = start + 1
    opening = body.find(b"{", at, stop)  # the next of each from ``at``: kept until passed
    closing = body.find(b"}", at, stop)
    for _ in range(2 * _MAX_NESTED - 1):  # each turn passes one brace (the first is passed)
        if closing < 0:
            return None
        if 0 <= opening < closing:
            depth += 1
            at = opening + 1
            opening = body.find(b"{", at, stop)
            continue
        depth -= 1
        at = closing + 1
        if depth == 0:
            try:
                usage = orjson.loads(body[start:at])
            except orjson.JSONDecodeError:
                return None
            return usage if isinstance(usage, dict) else None
        closing = body.find(b"}", at, stop)
    return None


def counts(
    usage: dict[str, Any] | None, prompt_key: str, output_key: str, details_key: str
) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, output tokens, cached tokens) from a usage object with these key names; each
    None where the engine did not say (vLLM reports cache hits only with
    ``--enable-prompt-tokens-details``)."""
    if usage is None:
        return None, None, None
    prompt = usage.get(prompt_key)
    completion = usage.get(output_key)
    details = usage.get(details_key)
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else None,
    )


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) from an OpenAI usage object."""
    return counts(usage, "prompt_tokens", "completion_tokens", "prompt_tokens_details")
