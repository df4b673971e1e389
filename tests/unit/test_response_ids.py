"""The map of client-chosen Responses ids: bounded in count and bytes, and never rebound; and the
path a stored response is asked for upstream."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.errors import BadRequest, NotFound
from taogate.proxy.forward import stored_item
from taogate.proxy.responses import MAX_ID_BYTES, ResponseIds, checked_id


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


def _scope(raw: bytes, query: bytes = b"") -> dict[str, object]:
    return {"path": unquote(raw.decode()), "raw_path": raw, "query_string": query}


def test_a_stored_response_s_path_loses_the_gateway_s_prefix_but_never_its_own_v1() -> None:
    plain = b"/v1/responses/resp_a"
    for prefix in ("", "/api", "/v1"):  # base_url = http://gw:8080/v1 gives a prefix of /v1
        assert stored_item(_scope(plain), prefix) == ("resp_a", plain), prefix
    assert stored_item(_scope(b"/v1" + plain), "/v1") == ("resp_a", plain)
    assert stored_item(_scope(b"/v1/responses" + plain), "/v1/responses") == ("resp_a", plain)
    cancel = stored_item(_scope(b"/api/v1/responses/resp_a/cancel"), "/api")
    assert cancel == ("resp_a", b"/v1/responses/resp_a/cancel")


def test_a_stored_response_s_path_is_read_as_it_was_routed_decoded_and_its_id_goes_as_sent() -> None:
    assert stored_item(_scope(b"/v1/%72esponses/resp_a"), "") == ("resp_a", b"/v1/responses/resp_a")
    assert stored_item(_scope(b"/%61pi/v1/responses/r%5Fa/%63ancel"), "/api") == (
        "r_a",
        b"/v1/responses/r%5Fa/%63ancel",
    )
    assert stored_item(_scope(b"/v1/responses/a%2Fb"), "") == ("a/b", b"/v1/responses/a%2Fb")
    for path in (b"/v1/responses/", b"/v1/responses/a/b", b"/v1/responses//cancel", b"/v1%2Fresponses/a"):
        with pytest.raises(NotFound):
            stored_item(_scope(path), "")
