"""Picker mode's pure pieces: header changes, subset hints and served endpoints (under the
Inference Extension's keys and llm-d's), body chunks."""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.picker.admit import header_changes
from taogate.picker.encoding import CHUNK, body_chunks
from taogate.picker.hints import endpoint_of, served_endpoint, subset_hint


def _metadata(namespace: str, key: str, value: Any) -> Any:
    struct = struct_pb2.Struct()
    struct.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: struct})


def test_header_changes_remove_credentials_and_keep_framing() -> None:
    before = [
        (b":path", b"/v1/chat/completions"),
        (b"authorization", b"Bearer client"),
        (b"content-length", b"12"),
        (b"x-keep", b"1"),
    ]
    after = [(b"x-keep", b"1"), (b"x-request-id", b"abc"), (b"authorization", b"Bearer instance")]
    set_headers, remove = header_changes(before, after)
    assert set_headers == [(b"x-request-id", b"abc"), (b"authorization", b"Bearer instance")]
    assert remove == []  # authorization is set anew; framing and pseudo-headers are the gateway's
    _, remove = header_changes(before, [(b"x-keep", b"1")])
    assert remove == [b"authorization"]


def test_subset_hint_as_list_or_string_and_absent() -> None:
    ns, key = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
    assert subset_hint(None) is None
    assert subset_hint(base_pb2.Metadata()) is None
    assert subset_hint(_metadata(ns, key, ["10.0.0.1:8000", "10.0.0.2:8000"])) == {
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    }
    assert subset_hint(_metadata(ns, key, "10.0.0.1:8000, 10.0.0.2:8000")) == {
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    }
    assert subset_hint(_metadata(ns, key, [])) == frozenset()


def test_served_endpoint() -> None:
    assert served_endpoint(None) is None
    meta = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", "10.0.0.3:8000")
    assert served_endpoint(meta) == "10.0.0.3:8000"


def test_llm_ds_metadata_keys_are_read_too() -> None:
    subset = _metadata(
        "envoy.lb.subset_hint", "x-llm-d-router-destination-endpoint-subset", ["10.0.0.1:8000"]
    )
    assert subset_hint(subset) == {"10.0.0.1:8000"}
    served = _metadata("envoy.lb", "x-llm-d-router-destination-endpoint-served", "10.0.0.3:8000")
    assert served_endpoint(served) == "10.0.0.3:8000"


@settings(deadline=None, max_examples=40)
@given(st.binary(max_size=3 * CHUNK), st.booleans())
def test_body_chunks_hand_back_the_body_whole(body: bytes, end: bool) -> None:
    chunks = [m.request_body.response.body_mutation.streamed_response for m in body_chunks(body, end=end)]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= CHUNK for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [end]


def test_an_instance_is_named_to_the_gateway_by_host_and_port_never_its_credentials() -> None:
    """What the pick and the subset hints compare: the URL's credentials (sent by the instance's
    own Basic auth) must not reach a header Envoy passes on, and a URL without a port has one."""
    assert endpoint_of("http://user:secret@10.0.0.5:8000") == "10.0.0.5:8000"
    assert endpoint_of("http://10.0.0.5") == "10.0.0.5:80"
    assert endpoint_of("https://10.0.0.5/v1") == "10.0.0.5:443"
    assert endpoint_of("http://[fd00::5]:8000") == "[fd00::5]:8000"
