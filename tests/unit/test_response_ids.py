"""The map of client-chosen Responses ids: bounded in count and bytes, and never rebound; and the
path a stored response is asked for upstream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.errors import BadRequest
from taogate.proxy.forward import item_id, upstream_path
from taogate.proxy.responses import MAX_ID_BYTES, ResponseIds, checked_id
from taogate.proxy.routes import RESPONSE_ITEM


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_id_keeps_its_first_instance_until_it_expires() -> None:
    clock = Clock()
    ids = ResponseIds(clock, ttl=10)
    ids.remember("conv", "a")
    ids.remember("conv", "b")
    assert ids.owner("conv", ["a", "b"]) == "a"
    clock.now = 11
    ids.remember("conv", "b")
    assert ids.owner("conv", ["a", "b"]) == "b"
    assert (len(ids), ids.bytes) == (1, 4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=40), max_size=60), st.integers(1, 200))
def test_the_map_never_holds_more_than_its_bytes(names: list[str], max_bytes: int) -> None:
    ids = ResponseIds(Clock(), limit=20, max_bytes=max_bytes)
    for name in names:
        ids.remember(name, "a")
        assert ids.bytes <= max_bytes and len(ids) <= 20
        assert ids.bytes == sum(len(n) for n in ids._chosen)


def test_a_chosen_id_is_bounded_in_bytes() -> None:
    assert checked_id("a" * MAX_ID_BYTES) == "a" * MAX_ID_BYTES
    for too_long in ("a" * (MAX_ID_BYTES + 1), "é" * (MAX_ID_BYTES // 2 + 1)):
        with pytest.raises(BadRequest) as caught:
            checked_id(too_long)
        assert caught.value.code == "invalid_request_id"


def test_a_stored_response_s_path_loses_the_gateway_s_prefix_but_never_its_own_v1() -> None:
    def scope(raw: bytes, query: bytes = b"") -> dict[str, object]:
        return {"path": raw.decode(), "raw_path": raw, "query_string": query}

    plain = b"/v1/responses/resp_a"
    for prefix in ("", "/api", "/v1"):  # base_url = http://gw:8080/v1 gives a prefix of /v1
        assert upstream_path(RESPONSE_ITEM, scope(plain), prefix) == plain, prefix
    assert upstream_path(RESPONSE_ITEM, scope(b"/v1" + plain), "/v1") == plain
    assert upstream_path(RESPONSE_ITEM, scope(b"/v1/responses" + plain), "/v1/responses") == plain
    cancel = upstream_path(RESPONSE_ITEM, scope(b"/api/v1/responses/resp_a/cancel", b"x=1"), "/api")
    assert cancel == b"/v1/responses/resp_a/cancel?x=1" and item_id(cancel) == "resp_a"
