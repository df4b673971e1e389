"""Hostile bodies the gateway itself reads: JSON nested deeper than it can serialise (orjson parses
1,024 levels and writes 254), odd Anthropic blocks, and a /v1/messages body of very many blocks.
Each is the client's 400 in its API's shape, or is served; never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.hostile.helpers import AUTH, MODEL, beside, gateway, in_thread

pytestmark = pytest.mark.timeout(90)

LONG = "a" * 600  # a history long enough to be keyed


DEEP = "<deep>"  # where the deep value goes: written as text, since orjson cannot write it


def _body(fields: dict[str, Any], levels: int) -> bytes:
    deep = b"[" * levels + b'"x"' + b"]" * levels
    return orjson.dumps({"model": MODEL, **fields}).replace(b'"<deep>"', deep)


def _post(url: str, path: str, body: bytes) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json"}
    with httpx.Client(headers=headers, timeout=30) as client:
        return client.post(url + path, content=body)


def _deep_bodies() -> list[tuple[str, dict[str, Any]]]:
    deep = DEEP
    user = {"role": "user", "content": LONG}
    tool_use = {"role": "user", "content": [{"type": "tool_use", "input": deep}]}
    return [
        ("/v1/chat/completions", {"messages": [{**user, "content": deep}, user]}),
        ("/v1/chat/completions", {"messages": [{**user, "x": deep}, user]}),
        ("/v1/chat/completions", {"messages": [user], "tools": [deep]}),
        ("/v1/responses", {"input": [user, user], "instructions": deep}),
        ("/v1/responses", {"input": LONG, "instructions": [deep]}),
        ("/v1/completions", {"prompt": deep}),
        ("/v1/messages", {"max_tokens": 2, "messages": [tool_use]}),
    ]


@pytest.mark.parametrize("levels", [255, 1000])
async def test_deep_nesting_is_a_clear_400_in_the_apis_shape_never_a_500(levels: int) -> None:
    refused = 0
    async with gateway() as (gw, _), beside(gw):
        for path, fields in _deep_bodies():
            r = await in_thread(_post, gw.url, path, _body(fields, levels))
            assert r.status_code in (200, 400), (path, r.status_code, r.text[:300])
            if r.status_code != 400 or "x-taogate-instance" in r.headers:
                continue  # a part the gateway does not read is the instance's to judge
            error = r.json()["error"]
            if path == "/v1/messages":
                assert (r.json()["type"], error["type"]) == ("error", "invalid_request_error"), r.text
            else:
                assert error["code"] == "too_deeply_nested", r.text
            refused += 1
        assert refused >= 5  # the history, tools, instructions and tool input the gateway reads


async def test_tool_results_of_plain_items_and_many_blocks_are_served() -> None:
    result = {"type": "tool_result", "tool_use_id": "t", "content": ["a", {"type": "text", "text": "b"}]}
    many = [{"type": "thinking", "thinking": "a"}] * 100_000  # 25 times the view's budget
    async with gateway() as (gw, _), beside(gw):
        # no instance serves the many blocks' model: what is measured is the gateway's own work
        for model, content, status in ((MODEL, [result], 200), ("no-such-model", many, 404)):
            body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
            r = await in_thread(_post, gw.url, "/v1/messages", orjson.dumps(body))
            assert r.status_code == status, r.text[:300]
