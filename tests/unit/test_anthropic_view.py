"""An Anthropic Messages body read as the chat request vLLM (0.32) turns it into: what dispatch
measures and keys by."""

from __future__ import annotations

import base64
from typing import Any

from taogate.dispatch.prefix import prefix_key
from taogate.dispatch.tokens import MAX_ITEMS, measure
from taogate.proxy.anthropic import BILLING_HEADER, chat_view

SYSTEM = "You are a careful coding assistant. " * 40
IMAGE = {
    "type": "image",
    "source": {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(b"\x89PNG" * 25_000).decode(),
    },
}


def _view(body: dict[str, Any]) -> dict[str, Any]:
    kind, chat = chat_view({"model": "m", "max_tokens": 8, **body})
    assert kind == "chat"
    return chat


def _claude_code(nonce: str) -> dict[str, Any]:
    billing = f"{BILLING_HEADER}: cc_version=2.1.80; cc_entrypoint=cli; cch={nonce};"
    system = [{"type": "text", "text": billing}, {"type": "text", "text": SYSTEM}]
    return {"system": system, "messages": [{"role": "user", "content": "fix the bug"}]}


def test_claude_code_s_billing_header_is_left_out_as_vllm_leaves_it_out() -> None:
    one, two = _view(_claude_code("1a2b3")), _view(_claude_code("9f8e7"))
    assert one == two and one["messages"][0] == {"role": "system", "content": SYSTEM}
    assert prefix_key("chat", one) == prefix_key("chat", two) is not None
    inline = {
        "messages": [
            {"role": "system", "content": f"{BILLING_HEADER}: cch=1;"},
            {"role": "user", "content": "hi"},
        ]
    }
    assert _view(inline)["messages"] == [{"role": "user", "content": "hi"}]
    assert _view({"system": f"{BILLING_HEADER}: cch=1;", "messages": []})["messages"] == []


def test_an_image_in_a_tool_result_is_an_image_not_its_base64_as_text() -> None:
    def with_result(content: list[Any]) -> Any:
        return measure(
            "chat",
            _view(
                {
                    "messages": [
                        {
                            "role": "assistant",
                            "content": [{"type": "tool_use", "id": "t", "name": "shot", "input": {}}],
                        },
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "t", "content": content}],
                        },
                    ]
                }
            ),
        )

    top = measure("chat", _view({"messages": [{"role": "user", "content": [IMAGE]}]}))
    nested = with_result([{"type": "text", "text": "the screen"}, IMAGE])
    assert nested.media == top.media == 1
    assert nested.chars < 200, nested  # the screenshot's 130,000 base64 characters are not text


def test_blocks_vllm_drops_are_not_counted() -> None:
    document = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "A" * 50_000},
    }
    redacted = {"type": "redacted_thinking", "data": "B" * 50_000}
    size = measure(
        "chat",
        _view(
            {
                "messages": [
                    {"role": "user", "content": [document, {"type": "text", "text": "summarise"}]},
                    {"role": "assistant", "content": [redacted, {"type": "text", "text": "ok"}]},
                ]
            }
        ),
    )
    assert size.chars < 100 and size.media == 0, size


def test_a_system_longer_than_the_budget_keeps_its_tail_for_the_measure() -> None:
    blocks = [{"type": "text", "text": "x"} for _ in range(MAX_ITEMS + 10)]
    system = _view({"system": blocks, "messages": []})["messages"][0]["content"]
    assert system[0] == {"type": "text", "text": "x" * MAX_ITEMS} and len(system) == 11
