"""The usage tap finds usage in an SSE stream however the bytes are chunked."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.relay import UsageTap

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


def test_no_usage_no_parse() -> None:
    tap = UsageTap()
    tap.feed(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    assert tap.usage is None
