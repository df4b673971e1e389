"""The usage tap finds usage in an SSE stream however the bytes are chunked."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.proxy import usage as usage_module
from taogate.proxy.relay import Events, EventTooLarge
from taogate.proxy.usage import UsageTap, spans_with, usage_of_body

STREAM = (
    b'data: {"id":"c1","choices":[{"text":"a"}]}\n\n'
    b'data: {"id":"c1","choices":[{"text":"b"}]}\n\n'
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
    b"data: [DONE]\n\n"
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=12, unique=True))
def test_usage_is_found_whatever_the_chunking(cuts: list[int]) -> None:
    tap = UsageTap()
    bounds = [0, *sorted(cuts), len(STREAM)]
    for a, b in itertools.pairwise(bounds):
        tap.feed(STREAM[a:b])
    assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, len(STREAM) + 3), max_size=12, unique=True))
def test_usage_is_found_in_crlf_framed_events_whatever_the_chunking(cuts: list[int]) -> None:
    stream = STREAM.replace(b"\n", b"\r\n")
    tap = UsageTap()
    bounds = [0, *sorted(c for c in cuts if c < len(stream)), len(stream)]
    ends = sum(tap.feed(stream[a:b]) for a, b in itertools.pairwise(bounds))
    assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert 1 <= ends <= 4


@pytest.mark.parametrize("piece", [1 << 14, 1 << 16, 1 << 18])
@pytest.mark.parametrize("size", [300_000, 1 << 20])
def test_the_usage_of_a_responses_answer_echoed_whole_is_found_in_any_pieces(piece: int, size: int) -> None:
    """``response.completed`` carries the whole answer and its usage after it: past the tap's bound
    only the event's end is held, and the usage is cut out of it."""
    completed = {
        "type": "response.completed",
        "response": {"id": "r1", "instructions": "x" * size, "output": [], "usage": NESTED, "user": None},
    }
    stream = b'data: {"type":"response.created"}\n\n' + b"data: " + _body(completed) + b"\n\n"
    stream += b'data: {"type":"after"}\n\n'
    tap = UsageTap()
    ends = sum(tap.feed(stream[at : at + piece]) for at in range(0, len(stream), piece))
    assert tap.usage == NESTED
    assert ends >= 2
    assert tap._size < 512 * 1024


def test_no_usage_no_parse() -> None:
    tap = UsageTap()
    tap.feed(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    assert tap.usage is None


def _body(obj: object, **dumps: Any) -> bytes:
    return json.dumps(obj, **dumps).encode()


USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
NESTED = {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}, "extra": {"a": {"b": 1}}}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_body({"id": "x", "choices": [{"text": "hi"}], "usage": USAGE}), USAGE),
        (_body({"id": "x", "usage": NESTED, "kv_transfer_params": None}), NESTED),
        (_body({"usage": NESTED}, indent=2), NESTED),  # pretty-printed
        (_body({"choices": [{"text": 'say "usage": {"prompt_tokens": 1}'}], "usage": USAGE}), USAGE),
        (_body({"choices": [{"text": 'the "usage": {}'}]}), None),  # only inside text: no usage
        (_body({"id": "x", "usage": None}), None),
        (_body({"id": "x"}), None),
        (b'{"id": "x", "usage" : {"prompt_tokens": 7}}', {"prompt_tokens": 7}),  # space before colon
        (b'{"usage": {"prompt_tokens": 7', None),  # cut short
        (b"[1, 2]", None),
    ],
)
def test_usage_of_a_whole_body(body: bytes, expected: dict[str, Any] | None) -> None:
    assert usage_of_body(body) == expected


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=200),
    usage=st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens"]), st.integers(0, 10**6))
    | st.none(),
    indent=st.none() | st.integers(0, 4),
)
def test_property_usage_of_body_is_what_a_full_parse_says(
    text: str, usage: dict[str, int] | None, indent: int | None
) -> None:
    obj: dict[str, Any] = {"id": "x", "choices": [{"text": text}]}
    if usage is not None:
        obj["usage"] = {**usage, "prompt_tokens_details": {"cached_tokens": 1}}
    body = _body(obj, indent=indent)
    assert usage_of_body(body) == obj.get("usage")


EVENTS = b'data: {"a":1}\n\nevent: e\r\ndata: {"b":2}\r\n\r\ndata: [DONE]\n\n'


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, len(EVENTS) + 20), max_size=12, unique=True), st.integers(0, 20))
def test_only_whole_events_are_relayed_whatever_the_chunking(cuts: list[int], unfinished: int) -> None:
    stream = EVENTS + b'data: {"c":'[:unfinished]
    bounds = [0, *sorted(c for c in cuts if c < len(stream)), len(stream)]
    events = Events()
    out = []
    for a, b in itertools.pairwise(bounds):
        whole = events.whole(stream[a:b])
        assert not whole or whole.endswith((b"\n\n", b"\n\r\n"))
        out.append(whole)
    assert b"".join(out) == EVENTS
    assert events.held == len(stream) - len(EVENTS)


def test_an_event_that_never_ends_is_bounded() -> None:
    events = Events(limit=1000)
    events.whole(b"data: " + b"a" * 900)
    with pytest.raises(EventTooLarge):
        events.whole(b"a" * 200)


def _cut_out_by_definition(body: bytes, start: int) -> dict[str, Any] | None:
    """``usage._cut_out`` as first written: both braces searched again at every turn."""
    while start < len(body) and body[start] in b" \t\r\n":
        start += 1
    if body[start : start + 1] != b"{":
        return None
    stop = min(len(body), start + usage_module._MAX_USAGE_BYTES)
    depth = 0
    at = start
    for _ in range(2 * usage_module._MAX_NESTED):
        opening = body.find(b"{", at, stop)
        closing = body.find(b"}", at, stop)
        if closing < 0:
            return None
        if 0 <= opening < closing:
            depth += 1
            at = opening + 1
            continue
        depth -= 1
        at = closing + 1
        if depth == 0:
            try:
                found = orjson.loads(body[start:at])
            except orjson.JSONDecodeError:
                return None
            return found if isinstance(found, dict) else None
    return None


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from([b"{", b"}", b'"a":1', b",", b" ", b'"b":{}', b"[]", b"x"]), max_size=60),
    st.integers(0, 3),
)
def test_property_the_usage_cut_finds_each_brace_once_and_cuts_what_it_cut(
    parts: list[bytes], start: int
) -> None:
    """Braces kept once found cut out exactly the object the brace-by-brace search did, nesting
    bound and size bound included."""
    body = b"".join(parts)
    assert usage_module._cut_out(body, start) == _cut_out_by_definition(body, start)
    deep = b"{" * 20 + b"}" * 20
    assert usage_module._cut_out(deep, 0) == _cut_out_by_definition(deep, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"data: a", b'data: {"usage":1}', b"data: b usage", b""]), max_size=12))
def test_the_events_holding_a_word_are_found_back_to_front_as_a_split_finds_them(events: list[bytes]) -> None:
    data = b"\n\n".join(events) + b"\n\n"
    found = [data[start:stop] for start, stop in spans_with(data, b"usage")]
    assert found == [e for e in reversed(data.split(b"\n\n")) if b"usage" in e]
