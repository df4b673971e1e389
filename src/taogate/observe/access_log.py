"""One structured log line per request: grep its id or its tag to find its whole story.

Never the key (only its name), never a body: only what dispatch decided and what it cost.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Literal

import orjson

from taogate.request_record import RequestRecord

log = logging.getLogger("taogate.access")


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


def _secs(value: float) -> str:
    """``str(round(value, 4))`` (the same text below a billion seconds, a test holds it to that), at
    about half the cost."""
    text = f"{value:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _text_line(rec: RequestRecord, text: Callable[[str], str] = _text) -> str:
    """The text line: the fields of ``_FIELDS`` in order, those that are None left out. Spelled out
    field by field, as a loop of getattr and checks cost several times as much (measured:
    benchmarks/overhead.py); a test holds it to ``_FIELDS``. The request id is already a safe token
    (``proxy.intake.request_id``), the route one of ours; ``text`` renders the other strings."""
    line = f"request_id={rec.request_id} route={rec.route}"
    if rec.key is not None:  # a configured name: already a safe token
        line += f" key={rec.key}"
    if rec.model is not None:
        line += f" model={text(rec.model)}"
    if rec.tag is not None:
        line += f" tag={text(rec.tag)}"
    if rec.instance is not None:
        line += f" instance={text(rec.instance)}"
    line += f" status={rec.status}"
    if rec.prompt_tokens is not None:
        line += f" prompt_tokens={rec.prompt_tokens}"
    if rec.prompt_tokens_est is not None:
        line += f" prompt_tokens_est={rec.prompt_tokens_est}"
    if rec.completion_tokens is not None:
        line += f" completion_tokens={rec.completion_tokens}"
    if rec.ttfb is not None:
        line += f" ttfb={_secs(rec.ttfb)}"
    line += f" duration={_secs(rec.duration)} queue_wait={_secs(rec.queue_wait)} retries={rec.retries}"
    if rec.channel_fallback is not None:
        line += f" channel_fallback={rec.channel_fallback}"
    if rec.priority is not None:
        line += f" priority={rec.priority}"
    if rec.error is not None:
        line += f" error={text(rec.error)}"
    return line


#: Strings (models, instances, tags, errors) whose text form an access log keeps, then starts over.
_TEXTS_KEPT = 256


class AccessLog:
    """Formats and writes the line, at INFO on the ``taogate.access`` logger.

    ``sink``, when given, writes the formatted line instead of a logging record (``taogate serve``
    passes its access handler's ``write_info``: the same text, much cheaper); the logger's level
    still decides whether a line is written at all."""

    def __init__(self, fmt: Literal["text", "json"], sink: Callable[[str], None] | None = None) -> None:
        self.fmt = fmt
        self._sink = sink
        self._texts: dict[str, str] = {}  # a string's text form: the same few recur on every line

    def _text(self, value: str) -> str:
        found = self._texts.get(value)
        if found is None:
            if len(self._texts) >= _TEXTS_KEPT:
                self._texts.clear()
            found = self._texts[value] = _text(value)
        return found

    def line(self, rec: RequestRecord) -> str:
        if self.fmt == "json":
            fields = {k: v for k in _FIELDS if (v := getattr(rec, k)) is not None}
            for k in _ROUNDED:
                if k in fields:
                    fields[k] = round(fields[k], 4)
            return _no_breaks(orjson.dumps(fields).decode())
        return _text_line(rec, self._text)

    def emit(self, rec: RequestRecord) -> None:
        if log.isEnabledFor(logging.INFO):
            if self._sink is not None:
                self._sink(self.line(rec))
            else:
                log.info("%s", self.line(rec))
