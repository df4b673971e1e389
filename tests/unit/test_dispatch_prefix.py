"""Prefix keys: which requests share a prompt prefix worth meeting on one instance."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.prefix import BLOCK_CHARS, MIN_PREFIX_CHARS, prefix_key, shared_prefix

CHAT = "/v1/chat/completions"
SYSTEM = "You are a meticulous assistant. " * 40  # ~1,300 chars


def chat(*messages: tuple[str, str], model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_chat_key_is_the_conversation_before_the_last_message() -> None:
    a = prefix_key(CHAT, chat(("system", SYSTEM), ("user", "What is prefill?")))
    b = prefix_key(CHAT, chat(("system", SYSTEM), ("user", "Why is my card slow?")))
    assert a is not None and a == b  # same system prompt, different questions: same instance
    other_system = prefix_key(CHAT, chat(("system", SYSTEM + "!"), ("user", "What is prefill?")))
    assert other_system != a


def test_chat_history_distinguishes_conversations_sharing_a_first_message() -> None:
    first = ("system", SYSTEM)
    turn_a = chat(first, ("user", "topic A"), ("assistant", "answer A"), ("user", "more"))
    turn_b = chat(first, ("user", "topic B"), ("assistant", "answer B"), ("user", "more"))
    assert prefix_key(CHAT, turn_a) != prefix_key(CHAT, turn_b)
    # The next turn of conversation A reuses what A's previous request sent.
    next_a = chat(first, ("user", "topic A"), ("assistant", "answer A"), ("user", "more"), ("assistant", "x"))
    assert shared_prefix(CHAT, next_a) is not None


def test_model_and_tools_are_part_of_the_key() -> None:
    body = chat(("system", SYSTEM), ("user", "q"))
    assert prefix_key(CHAT, body) != prefix_key(CHAT, {**body, "model": "other"})
    assert prefix_key(CHAT, body) != prefix_key(CHAT, {**body, "tools": [{"type": "function"}]})


def test_single_message_and_completions_use_a_leading_block() -> None:
    shared = "Summarise the following report. " * 100
    one = prefix_key(CHAT, chat(("user", shared + "request number 1")))
    two = prefix_key(CHAT, chat(("user", shared + "request number 2")))
    assert one is not None and one == two
    c1 = prefix_key("/v1/completions", {"model": "m", "prompt": shared + "request number 1"})
    c2 = prefix_key("/v1/completions", {"model": "m", "prompt": shared + "request number 2"})
    assert c1 is not None and c1 == c2
    found = shared_prefix("/v1/completions", {"model": "m", "prompt": shared})
    assert found is not None and found.size.ascii == BLOCK_CHARS


def test_article_workload_shares_one_key() -> None:
    base = "The quick brown fox jumps over the lazy dog. " * 400
    keys = {
        prefix_key("/v1/completions", {"model": "m", "prompt": f"{base} request number {i}"})
        for i in range(64)
    }
    assert len(keys) == 1 and None not in keys


def test_short_prompts_have_no_key() -> None:
    assert prefix_key("/v1/completions", {"model": "m", "prompt": "hi"}) is None
    assert prefix_key(CHAT, chat(("system", "short"), ("user", "hi"))) is None
    assert prefix_key("/v1/completions", {"model": "m", "prompt": list(range(64))}) is None
    assert prefix_key("/v1/completions", {"model": "m", "prompt": list(range(300))}) is not None
    assert prefix_key("/v1/embeddings", {"model": "m", "input": SYSTEM}) is None
    assert prefix_key("/tokenize", {"model": "m", "prompt": SYSTEM}) is None
    assert prefix_key(CHAT, {"model": "m", "messages": "not a list"}) is None


def test_short_history_with_a_long_last_message_uses_the_leading_block() -> None:
    body = chat(("system", "Be brief."), ("user", SYSTEM))
    found = shared_prefix(CHAT, body)
    assert found is not None
    assert found.size.ascii == BLOCK_CHARS


def test_responses_input() -> None:
    r1 = {"model": "m", "instructions": SYSTEM, "input": "question one"}
    r2 = {"model": "m", "instructions": SYSTEM, "input": "question two"}
    assert prefix_key("/v1/responses", r1) == prefix_key("/v1/responses", r2) is not None
    items = {"model": "m", "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]}
    assert prefix_key("/v1/responses", items) is not None


@settings(max_examples=30, deadline=None)
@given(text=st.text(min_size=MIN_PREFIX_CHARS, max_size=3000), tail=st.text(max_size=200))
def test_property_key_is_stable_64_bit_and_ignores_the_tail(text: str, tail: str) -> None:
    base = text[:BLOCK_CHARS]
    k1 = prefix_key("/v1/completions", {"model": "m", "prompt": base + tail})
    k2 = prefix_key("/v1/completions", {"model": "m", "prompt": base + tail})
    assert k1 is not None and k1 == k2
    assert 0 <= k1 < 2**64
    if len(base) == BLOCK_CHARS:
        assert prefix_key("/v1/completions", {"model": "m", "prompt": base}) == k1
