"""The access line: one parseable line per request, the same fields in text and JSON."""

from __future__ import annotations

import io
import logging
import math
import re

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.observe.access_log import _FIELDS, _ROUNDED, AccessLog, _secs, _text
from taogate.observe.logs import LOG_FORMAT, BatchedStreamHandler, SecondCachedFormatter
from taogate.request_record import RequestRecord


def reference_text_line(rec: RequestRecord) -> str:
    """The text format by definition: every non-None field of ``_FIELDS``, in order."""
    parts = []
    for k in _FIELDS:
        v = getattr(rec, k)
        if v is not None:
            parts.append(f"{k}={_text(round(v, 4) if k in _ROUNDED else v)}")
    return " ".join(parts)


maybe_int = st.none() | st.integers(0, 10**7)
maybe_text = st.none() | st.text(max_size=40)
records = st.builds(
    RequestRecord,
    request_id=st.text("0123456789abcdef-_", min_size=1, max_size=32),
    route=st.sampled_from(["chat", "completions", "embeddings"]),
    started=st.just(0.0),
    model=maybe_text,
    tag=maybe_text,
    instance=maybe_text,
    status=st.integers(100, 599),
    prompt_tokens=maybe_int,
    prompt_tokens_est=maybe_int,
    completion_tokens=maybe_int,
    ttfb=st.none() | st.floats(0, 1e4),
    duration=st.floats(0, 1e4),
    queue_wait=st.floats(0, 1e3),
    retries=st.integers(0, 5),
    channel_fallback=st.none() | st.booleans(),
    priority=st.none() | st.integers(-5, 20),
    error=maybe_text,
)


@settings(max_examples=300, deadline=None)
@given(rec=records)
def test_property_the_text_line_is_every_field_in_order(rec: RequestRecord) -> None:
    line = AccessLog("text").line(rec)
    assert line == reference_text_line(rec)
    assert "\n" not in line and "\r" not in line


@settings(max_examples=100, deadline=None)
@given(rec=records)
def test_property_text_and_json_carry_the_same_fields(rec: RequestRecord) -> None:
    fields = orjson.loads(AccessLog("json").line(rec))
    assert list(fields) == [k for k in _FIELDS if getattr(rec, k) is not None]


@settings(max_examples=200, deadline=None)
@given(created=st.lists(st.floats(1.6e9, 1.9e9), min_size=1, max_size=5))
def test_property_the_cached_timestamp_is_the_standard_one(created: list[float]) -> None:
    cached, standard = SecondCachedFormatter(LOG_FORMAT), logging.Formatter(LOG_FORMAT)
    for t in [*sorted(created), created[0]]:  # forwards, then back to a second seen before
        record = logging.LogRecord("taogate.access", logging.INFO, __file__, 1, "line", (), None)
        record.created, record.msecs = t, int((t - int(t)) * 1000)
        assert cached.format(record) == standard.format(record)


def test_the_direct_access_line_is_the_logging_line() -> None:
    """``taogate serve`` writes access lines through ``write_info`` instead of logging records: the
    text must be what the logging path gives, timestamp format included."""
    handler = BatchedStreamHandler()
    handler.setFormatter(SecondCachedFormatter(LOG_FORMAT))
    handler.stream = io.StringIO()
    rec = RequestRecord(request_id="r1", route="chat", started=0.0, model="m", instance="i0", status=200)
    line = AccessLog("text").line(rec)
    handler.write_info("taogate.access", line)
    handler.handle(logging.LogRecord("taogate.access", logging.INFO, __file__, 1, "%s", (line,), None))
    direct, logged = handler.stream.getvalue().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + " INFO taogate.access: " + re.escape(line), direct)
    assert direct[23:] == logged[23:]  # the same line after the 23-character timestamp


def test_access_lines_go_to_the_sink_when_given_and_the_level_allows() -> None:
    got: list[str] = []
    rec = RequestRecord(request_id="r1", route="chat", started=0.0, status=200)
    access = logging.getLogger("taogate.access")
    level = access.level
    try:
        access.setLevel(logging.INFO)
        AccessLog("text", got.append).emit(rec)
        access.setLevel(logging.WARNING)
        AccessLog("text", got.append).emit(rec)
    finally:
        access.setLevel(level)
    assert got == [AccessLog("text").line(rec)]


#: Every separator ``str.splitlines`` splits on (the Python docs' list; orjson leaves the last three raw).
SEPARATORS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
hostile_text = st.none() | st.text(st.sampled_from([*SEPARATORS, "a", " ", '"', "=", "é", "\\"]), max_size=40)
hostile_records = st.builds(
    RequestRecord,
    request_id=st.just("id"),
    route=st.just("chat"),
    started=st.just(0.0),
    model=hostile_text,
    tag=hostile_text,
    error=hostile_text,
)


@settings(max_examples=300, deadline=None)
@given(rec=hostile_records, fmt=st.sampled_from(["text", "json"]))
def test_property_no_line_separator_splits_an_access_line(rec: RequestRecord, fmt: str) -> None:
    line = AccessLog(fmt).line(rec)
    assert len(line.splitlines()) == 1
    if fmt == "json":
        decoded = orjson.loads(line)
        assert (decoded.get("model"), decoded.get("tag"), decoded.get("error")) == (
            rec.model,
            rec.tag,
            rec.error,
        )


@settings(max_examples=2000, deadline=None)
@given(st.floats(min_value=-1e9, max_value=1e9) | st.sampled_from([math.inf, math.nan]))
def test_property_seconds_read_as_round_to_four_places(value: float) -> None:
    """Up to a billion seconds: beyond, a double has fewer than four decimal places to show."""
    assert _secs(value) == str(round(value, 4))


def test_an_access_log_keeps_a_bounded_set_of_texts() -> None:
    log = AccessLog("text")
    for i in range(1000):
        assert log.line(RequestRecord("r", "chat", 0.0, model=f"m {i}")).split(" ")[2] == 'model="m'
    assert len(log._texts) <= 256
