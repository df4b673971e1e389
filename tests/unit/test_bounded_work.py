"""Work per request is bounded by the input, never quadratic, over adversarial shapes: the prompt
size and the prefix key read at most a fixed number of items whatever the body holds (the rest of
a long list is extrapolated), the usage tap copies each byte at most twice, and the usage probe
finds what a full parse finds. Counted, not timed: ``benchmarks/hostile.py`` prints the times."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch import prefix, tokens
from taogate.dispatch.tokens import MAX_ITEMS, PromptSize, measure
from taogate.proxy.usage import UsageTap, usage_of_body

#: Items a measurement may read: the budget, a second one for lists met after it, the nesting.
BOUND = 2 * MAX_ITEMS + 64


@contextmanager
def counted(module: Any, *names: str) -> Iterator[list[int]]:
    """Count the calls to ``module``'s functions ``names`` (their callers look them up by name)."""
    calls = [0]
    originals = {name: getattr(module, name) for name in names}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return fn(*args, **kwargs)

        return inner

    for name, fn in originals.items():
        setattr(module, name, wrap(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


WORDS = st.sampled_from(["w", "", "héllo", "你好", "🙂", "word " * 20])
PART = st.builds(lambda t, kind: {"type": kind, "text": t}, WORDS, st.sampled_from(["text", "input_text"]))
IMAGE = st.just({"type": "image_url", "image_url": {"url": "data:"}})


def _shapes() -> st.SearchStrategy[tuple[str, dict[str, Any], int]]:
    """(route, body, how many leaf items it holds): few distinct items repeated very many times."""
    n = st.integers(0, 300_000)
    return st.one_of(
        st.builds(lambda w, k: ("completions", {"prompt": [w] * k}, k), WORDS, n),
        st.builds(
            lambda w, k, j: ("completions", {"prompt": [[w] * j] * k}, k * j), WORDS, n, st.integers(1, 50)
        ),
        st.builds(lambda k: ("completions", {"prompt": [7] * k}, k), n),
        st.builds(lambda w, k: ("embeddings", {"input": [w] * k}, k), WORDS, n),
        st.builds(lambda w, k: ("chat", {"messages": [{"role": "user", "content": w}] * k}, k), WORDS, n),
        st.builds(
            lambda p, k, j: ("chat", {"messages": [{"role": "user", "content": [p] * j}] * k}, k * j),
            PART | IMAGE,
            st.integers(0, 2_000),
            st.integers(0, 2_000),
        ),
        st.builds(lambda w, k: ("responses", {"input": [{"role": "user", "content": w}] * k}, k), WORDS, n),
        st.builds(
            lambda w, k: (
                "chat",
                {"messages": [{"role": "user", "content": w * 50_000}, *[{"content": w}] * k]},
                k,
            ),
            WORDS,
            n,
        ),
    )


@settings(max_examples=60, deadline=None)
@given(_shapes())
def test_property_the_prompt_size_reads_a_bounded_number_of_items(
    case: tuple[str, dict[str, Any], int],
) -> None:
    route, body, _ = case
    with counted(tokens, "_message", "_part", "_prompt") as calls:
        measure(route, body)
    assert calls[0] <= BOUND


@settings(max_examples=60, deadline=None)
@given(_shapes())
def test_property_the_prefix_key_reads_a_bounded_number_of_items(
    case: tuple[str, dict[str, Any], int],
) -> None:
    route, body, _ = case
    with counted(prefix, "_message_text", "_canonical") as calls:
        prefix.shared_prefix(route, {"model": "m", **body})
    assert calls[0] <= 2 * BOUND


@settings(max_examples=60, deadline=None)
@given(w=WORDS, k=st.integers(1, 200_000))
def test_property_a_uniform_list_is_extrapolated_exactly(w: str, k: int) -> None:
    one = measure("completions", {"prompt": w})
    assert measure("completions", {"prompt": [w] * k}) == PromptSize(
        ascii=one.ascii * k, cjk=one.cjk * k, other=one.other * k
    )
    chat = measure("chat", {"messages": [{"role": "user", "content": w}] * k})
    single = measure("chat", {"messages": [{"role": "user", "content": w}]})
    assert chat.messages == k and chat.ascii == single.ascii * k and chat.cjk == single.cjk * k


def test_a_short_message_after_a_huge_one_is_counted_as_it_is() -> None:
    size = measure(
        "chat", {"messages": [{"role": "u", "content": ["a"] * 100_000}, {"role": "u", "content": "b"}]}
    )
    assert size.messages == 2 and 100_000 <= size.ascii <= 100_000 + 4


def test_a_long_non_ascii_text_is_classified_on_a_sample() -> None:
    text = ("你好" * 3 + "é") * 100_000
    size = measure("completions", {"prompt": text})
    assert size.ascii == 0 and abs(size.cjk - 600_000) <= 6_000 and size.cjk + size.other == len(text)


# -- the usage tap and probe ---------------------------------------------------------------------


def _stream(events: list[bytes]) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.sampled_from([b'{"a":1}', b'{"usage":{"prompt_tokens":3}}', b"x" * 300, b""]), max_size=12
    ),
    cuts=st.lists(st.integers(1, 4_000), max_size=20, unique=True),
    crlf=st.booleans(),
)
def test_property_the_tap_says_which_chunks_end_an_event(
    events: list[bytes], cuts: list[int], crlf: bool
) -> None:
    data = _stream(events)
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    blank = b"\r\n\r\n" if crlf else b"\n\n"
    ends = {i + len(blank) for i in range(len(data)) if data.startswith(blank, i)}
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    tap = UsageTap()
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        # an event ends in the chunk when its blank line's last byte is in it
        assert tap.feed(data[a:b]) == any(a < end <= b for end in ends), (a, b)


def test_an_event_that_never_ends_is_held_only_up_to_a_bound() -> None:
    tap = UsageTap()
    for _ in range(300_000):
        assert tap.feed(b'"usage"') is False
    assert tap._size <= 256 * 1024
    assert tap.feed(b'\n\ndata: {"usage": {"prompt_tokens": 2}}\n\n') is True
    assert tap.usage == {"prompt_tokens": 2}


NESTED = st.recursive(
    st.integers(0, 10**6) | st.none(),
    lambda inner: (
        st.dictionaries(st.sampled_from(["a", "b", "cached_tokens", "x"]), inner, max_size=3)
        | st.lists(inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    usage=st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "details", "extra"]), NESTED
    ),
    pairs=st.integers(0, 5_000),
)
def test_property_the_usage_probe_finds_what_a_full_parse_finds(usage: dict[str, Any], pairs: int) -> None:
    obj = {"id": "x", "choices": [{"text": "t"}], "usage": {**usage, "many": [{}] * pairs}}
    assert usage_of_body(orjson.dumps(obj)) == obj["usage"]


@pytest.mark.parametrize("pairs", [100_000, 300_000])
def test_a_usage_of_many_nested_pairs_is_parsed_whole_once(pairs: int) -> None:
    body = b'{"usage":{"prompt_tokens":1,"x":[' + b",".join([b"{}"] * pairs) + b"]}}"
    found = usage_of_body(body)
    assert (found is None) == (len(body) > 1 << 20)
    if found is not None:
        assert found["prompt_tokens"] == 1
