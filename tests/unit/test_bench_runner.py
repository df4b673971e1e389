"""What the load generator counts as a request's first token."""

from __future__ import annotations

from taogate.bench.runner import _has_token


def test_text_or_content_is_a_first_token_and_a_role_alone_is_not() -> None:
    assert _has_token({"choices": [{"index": 0, "text": "Hi"}]})
    assert _has_token({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert not _has_token({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not _has_token({"choices": [], "usage": {"prompt_tokens": 3}})


def test_a_token_without_text_counts_when_it_ends_the_answer() -> None:
    # Half of a character split over two byte-level tokens has no text; with max_tokens 1 the
    # answer's only event is its end, and without it the request would have no TTFT at all.
    assert _has_token({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert not _has_token({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
