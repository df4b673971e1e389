"""One structured log line per request: grep its id or its tag to find its whole story.

Never the key (only its name), never a body: only what dispatch decided and what it cost.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import orjson

log = logging.getLogger("taogate.access")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    route: str
    started: float
    key: str | None = None  # the client key's name (never the key itself)
    model: str | None = None
    client_tag: str | None = None
    tag: str | None = None
    long: bool = False
    instance: str | None = None
    status: int = 500
    prompt_tokens_est: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served by the prefix cache; None: usage did not say
    ttfb: float | None = None
    duration: float = 0.0
    queue_wait: float = 0.0
    retries: int = 0
    channel_fallback: bool | None = None  # True: sent outside its long/short channel
    error: str | None = None
    reject: str | None = None
    priority: int | None = None  # the priority class, when not the default (0)


_FIELDS = (
    "request_id",
    "route",
    "key",
    "model",
    "tag",
    "instance",
    "status",
    "prompt_tokens",
    "prompt_tokens_est",
    "completion_tokens",
    "ttfb",
    "duration",
    "queue_wait",
    "retries",
    "channel_fallback",
    "priority",
    "error",
)


_UNSAFE = re.compile(r'[ "=]')
_ROUNDED = frozenset({"ttfb", "duration", "queue_wait"})
#: The line separators ``str.splitlines`` knows that JSON escaping leaves as they are (orjson escapes
#: the control characters among them, U+0000-U+001F, itself).
_RAW_BREAKS = re.compile("[\x85\u2028\u2029]")


def _no_breaks(line: str) -> str:
    """``line`` with every line separator left escaped as ``\\uXXXX``: a log reader splitting on
    any of them still sees one request per line. They can only be inside JSON strings here, so the
    result is the same JSON."""
    if line.isascii() or _RAW_BREAKS.search(line) is None:
        return line
    return _RAW_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def _text(value: object) -> str:
    """A value for the text format: client-supplied strings (model, tag) are cut and quoted when they
    hold spaces, quotes or line breaks, so one request is always exactly one parseable line."""
    if not isinstance(value, str):
        return str(value)
    value = value[:128]
    if value and value.isprintable() and _UNSAFE.search(value) is None:
        return value
    return _no_breaks(orjson.dumps(value).decode())


def _text_line(rec: RequestRecord) -> str:
    """The text line: the fields of ``_FIELDS`` in order, those that are None left out. Spelled out
    field by field, as a loop of getattr and checks cost several times as much (measured:
    benchmarks/overhead.py); a test holds it to ``_FIELDS``. The request id is already a safe token
    (``proxy.intake.request_id``), the route one of ours."""
    parts = [f"request_id={rec.request_id}", f"route={rec.route}"]
    if rec.key is not None:  # a configured name: already a safe token
        parts.append(f"key={rec.key}")
    if rec.model is not None:
        parts.append(f"model={_text(rec.model)}")
    if rec.tag is not None:
        parts.append(f"tag={_text(rec.tag)}")
    if rec.instance is not None:
        parts.append(f"instance={_text(rec.instance)}")
    parts.append(f"status={rec.status}")
    if rec.prompt_tokens is not None:
        parts.append(f"prompt_tokens={rec.prompt_tokens}")
    if rec.prompt_tokens_est is not None:
        parts.append(f"prompt_tokens_est={rec.prompt_tokens_est}")
    if rec.completion_tokens is not None:
        parts.append(f"completion_tokens={rec.completion_tokens}")
    if rec.ttfb is not None:
        parts.append(f"ttfb={round(rec.ttfb, 4)}")
    parts.append(f"duration={round(rec.duration, 4)}")
    parts.append(f"queue_wait={round(rec.queue_wait, 4)}")
    parts.append(f"retries={rec.retries}")
    if rec.channel_fallback is not None:
        parts.append(f"channel_fallback={rec.channel_fallback}")
    if rec.priority is not None:
        parts.append(f"priority={rec.priority}")
    if rec.error is not None:
        parts.append(f"error={_text(rec.error)}")
    return " ".join(parts)


class AccessLog:
    """Formats and writes the line, at INFO on the ``taogate.access`` logger.

    ``sink``, when given, writes the formatted line instead of a logging record (``taogate serve``
    passes its access handler's ``write_info``: the same text, much cheaper); the logger's level
    still decides whether a line is written at all."""

    def __init__(self, fmt: Literal["text", "json"], sink: Callable[[str], None] | None = None) -> None:
        self.fmt = fmt
        self._sink = sink

    def line(self, rec: RequestRecord) -> str:
        if self.fmt == "json":
            fields = {k: v for k in _FIELDS if (v := getattr(rec, k)) is not None}
            for k in _ROUNDED:
                if k in fields:
                    fields[k] = round(fields[k], 4)
            return _no_breaks(orjson.dumps(fields).decode())
        return _text_line(rec)

    def emit(self, rec: RequestRecord) -> None:
        if log.isEnabledFor(logging.INFO):
            if self._sink is not None:
                self._sink(self.line(rec))
            else:
                log.info("%s", self.line(rec))
