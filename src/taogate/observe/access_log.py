"""One structured log line per request: grep its id or its tag to find its whole story.

Never the key (only its name), never a body: only what dispatch decided and what it cost.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from math import copysign
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
    field by field in one f-string (a loop of getattr and checks, or a string grown field by field,
    costs more); a test holds it to ``_FIELDS``. The request id is already a safe token
    (``proxy.intake.request_id``), the route one of ours, a key's name a configured token; ``text``
    renders the other strings."""
    key, model, tag, instance = rec.key, rec.model, rec.tag, rec.instance
    prompt, estimate, completion, ttfb = (
        rec.prompt_tokens,
        rec.prompt_tokens_est,
        rec.completion_tokens,
        rec.ttfb,
    )
    fallback, priority, error, wait = rec.channel_fallback, rec.priority, rec.error, rec.queue_wait
    return (
        f"request_id={rec.request_id} route={rec.route}"
        f"{'' if key is None else ' key=' + key}"
        f"{'' if model is None else ' model=' + text(model)}"
        f"{'' if tag is None else ' tag=' + text(tag)}"
        f"{'' if instance is None else ' instance=' + text(instance)}"
        f" status={rec.status}"
        f"{'' if prompt is None else f' prompt_tokens={prompt}'}"
        f"{'' if estimate is None else f' prompt_tokens_est={estimate}'}"
        f"{'' if completion is None else f' completion_tokens={completion}'}"
        f"{'' if ttfb is None else ' ttfb=' + _secs(ttfb)}"
        f" duration={_secs(rec.duration)}"
        f" queue_wait={'0.0' if wait == 0.0 and copysign(1.0, wait) > 0 else _secs(wait)}"  # most wait none
        f" retries={rec.retries}"
        f"{'' if fallback is None else f' channel_fallback={fallback}'}"
        f"{'' if priority is None else f' priority={priority}'}"
        f"{'' if error is None else ' error=' + text(error)}"
    )


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
