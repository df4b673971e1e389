"""Prompt size from request bodies, and the per-model calibration of the token estimate."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.tokens import (
    PromptSize,
    TokenizerUnavailable,
    load_exact_counter,
    measure,
    measure_text,
    route_kind,
)


class FakeExact:
    def count(self, text: str) -> int:
        return len(text.split())


def test_measure_text_classes() -> None:
    assert measure_text("hello world") == PromptSize(ascii=11)
    assert measure_text("你好，世界") == PromptSize(cjk=5)  # full-width comma is CJK punctuation
    assert measure_text("日本語のテキスト한국어") == PromptSize(cjk=11)
    assert measure_text("héllo привет 🙂") == PromptSize(ascii=6, other=8)
    assert measure_text("") == PromptSize()


def test_route_kind_ignores_prefixes_and_accepts_kinds() -> None:
    assert route_kind("chat") == "chat"
    assert route_kind("detokenize") == "other"
    assert route_kind("/v1/chat/completions") == "chat"
    assert route_kind("/api/v1/chat/completions/") == "chat"
    assert route_kind("/v1/completions") == "completions"
    assert route_kind("/api/v1/embeddings") == "embeddings"
    assert route_kind("/v1/responses") == "responses"
    assert route_kind("/tokenize") == "tokenize"
    assert route_kind("/v1/models") == "other"


def test_completions_prompt_shapes() -> None:
    route = "/v1/completions"
    assert measure(route, {"prompt": "abc"}) == PromptSize(ascii=3)
    assert measure(route, {"prompt": ["ab", "c"]}) == PromptSize(ascii=3)
    assert measure(route, {"prompt": [1, 2, 3]}) == PromptSize(tokens=3)
    assert measure(route, {"prompt": [[1, 2], [3]]}) == PromptSize(tokens=3)
    assert measure(route, {"prompt": "ab", "suffix": "cd"}) == PromptSize(ascii=4)
    assert measure(route, {}) == PromptSize()
    assert measure(route, {"prompt": 42}) == PromptSize()  # odd bodies never raise


def test_chat_counts_roles_content_parts_and_overhead() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "你好"},
                    {"type": "image_url", "image_url": {"url": "data:..."}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
            },
        ]
    }
    size = measure("/v1/chat/completions", body)
    assert size.messages == 3
    assert size.media == 1
    assert size.cjk == 2
    # roles (6 + 4 + 9) + "Be brief." (9) + the tool call's JSON
    assert size.ascii > 6 + 4 + 9 + 9
    with_tools = measure("/v1/chat/completions", {**body, "tools": [{"type": "function", "name": "x"}]})
    assert with_tools.ascii > size.ascii


def test_embeddings_responses_tokenize() -> None:
    assert measure("/v1/embeddings", {"input": ["a", "bb"]}) == PromptSize(ascii=3)
    assert measure("/v1/embeddings", {"input": [[1, 2, 3]]}) == PromptSize(tokens=3)
    assert measure("/v1/responses", {"input": "hello"}) == PromptSize(ascii=5)
    items = {
        "instructions": "sys",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    }
    assert measure("/v1/responses", items) == PromptSize(ascii=3 + 4 + 2, messages=1)
    assert measure("/tokenize", {"prompt": "abcd"}) == PromptSize(ascii=4)
    assert measure("/tokenize", {"messages": [{"role": "user", "content": "x"}]}) == PromptSize(
        ascii=5, messages=1
    )


def test_exact_counter_counts_plain_text_only() -> None:
    exact = FakeExact()
    assert measure("/v1/completions", {"prompt": "a b c"}, exact) == PromptSize(tokens=3)
    chat = measure("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}]}, exact)
    assert chat.tokens == 0 and chat.ascii == 7


def test_exact_mode_errors_are_clear() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(TokenizerUnavailable, match="pip install tokenizers"):
            load_exact_counter("/nonexistent/tokenizer.json")
    else:  # pragma: no cover - depends on the environment
        with pytest.raises(TokenizerUnavailable, match="no such file"):
            load_exact_counter("/nonexistent/tokenizer.json")


def test_prior_rule_and_floor() -> None:
    est = TokenEstimator(chars_per_token=4.0)
    assert est.estimate("m", PromptSize(ascii=4000)) == 1001  # 1000 + the BOS-ish bias
    assert 700 <= est.estimate("m", PromptSize(cjk=1000)) <= 1000  # ~1.25 chars per token
    assert est.estimate("m", PromptSize()) == 1
    assert est.estimate("m", PromptSize(tokens=7)) == 8
    assert est.observations("m") == 0


def _true_rule(size: PromptSize) -> int:
    return round(size.ascii / 3.3 + size.cjk * 1.1 + size.other * 0.6 + size.messages * 6 + 2 + size.tokens)


def _sizes(rng: random.Random, n: int) -> list[PromptSize]:
    out = []
    for _ in range(n):
        mixed = rng.random() < 0.5
        out.append(
            PromptSize(
                ascii=rng.randint(0, 8000),
                cjk=rng.randint(0, 3000) if mixed else 0,
                other=rng.randint(0, 300) if rng.random() < 0.3 else 0,
                messages=rng.randint(0, 6),
            )
        )
    return out


def test_calibration_converges_in_a_handful_of_observations() -> None:
    rng = random.Random(7)
    est = TokenEstimator()
    for size in _sizes(rng, 12):
        est.observe("m", size, _true_rule(size))
    errors = [abs(est.estimate("m", s) - _true_rule(s)) / _true_rule(s) for s in _sizes(rng, 200)]
    assert max(errors) < 0.05
    assert est.observations("m") == 12
    assert est.estimate("other-model", PromptSize(ascii=3300)) == 826  # untouched prior


def test_calibration_survives_outliers() -> None:
    rng = random.Random(3)
    est = TokenEstimator()
    for size in _sizes(rng, 30):
        est.observe("m", size, _true_rule(size))
    bad = PromptSize(ascii=4000)
    est.observe("m", bad, 50 * _true_rule(bad))  # e.g. a response whose usage was garbage
    errors = [abs(est.estimate("m", s) - _true_rule(s)) / _true_rule(s) for s in _sizes(rng, 100)]
    assert sum(errors) / len(errors) < 0.15


def test_models_are_bounded_lru() -> None:
    est = TokenEstimator(max_models=3)
    for name in ("a", "b", "c"):
        est.observe(name, PromptSize(ascii=400), 200)
    est.observe("a", PromptSize(ascii=400), 200)  # refresh a
    est.observe("d", PromptSize(ascii=400), 200)  # evicts b, the least recently used
    assert len(est) == 3
    assert est.observations("b") == 0
    assert est.observations("a") == 2


def test_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        TokenEstimator(chars_per_token=0)


@settings(max_examples=40, deadline=None)
@given(
    ascii_rate=st.floats(0.15, 0.6),
    cjk_rate=st.floats(0.5, 1.6),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_converges_to_a_true_linear_rule(ascii_rate: float, cjk_rate: float, seed: int) -> None:
    """From random mixed English/CJK texts, the fit learns any plausible linear rule."""
    rng = random.Random(seed)
    words = ["the", "prefill", "token", "cache", "instance", "queue"]
    han = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主"

    def text() -> str:
        parts = [
            " ".join(rng.choices(words, k=rng.randint(0, 600))),
            "".join(rng.choices(han, k=rng.randint(0, 800) if rng.random() < 0.6 else 0)),
        ]
        rng.shuffle(parts)
        return "".join(parts)

    def rule(size: PromptSize) -> int:
        return round(size.ascii * ascii_rate + size.cjk * cjk_rate + 1)

    est = TokenEstimator()
    for _ in range(20):
        size = measure_text(text())
        est.observe("m", size, rule(size))
    for _ in range(20):
        size = measure_text(text())
        truth = rule(size)
        assert abs(est.estimate("m", size) - truth) <= 0.05 * truth + 3


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(
            st.builds(
                PromptSize,
                ascii=st.integers(0, 10**7),
                cjk=st.integers(0, 10**6),
                other=st.integers(0, 10**6),
                messages=st.integers(0, 1000),
                media=st.integers(0, 50),
                tokens=st.integers(0, 10**6),
            ),
            st.integers(-5, 10**8),
        ),
        max_size=12,
    ),
    probe=st.builds(PromptSize, ascii=st.integers(0, 10**7), cjk=st.integers(0, 10**6)),
)
def test_property_estimate_is_finite_and_at_least_one(
    sizes: list[tuple[PromptSize, int]], probe: PromptSize
) -> None:
    est = TokenEstimator()
    for size, observed in sizes:
        est.observe("m", size, observed)
        value = est.estimate("m", size)
        assert value >= 1 and math.isfinite(value)
    assert est.estimate("m", probe) >= 1
    assert est.estimate("m", PromptSize()) >= 1
