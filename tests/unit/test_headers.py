"""What crosses the proxied hop in each direction: hop-by-hop fields (and those a Connection field
names) never do, nor credentials, nor anything in the gateway's own namespace."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.fleet.instance import InstanceSpec
from taogate.proxy.forward import Forward
from taogate.proxy.upstream import (
    _DROP_DOWN,
    _DROP_DOWN_LOAD,
    _DROP_UP,
    HOP_BY_HOP,
    _nominated,
    downstream_headers,
    upstream_headers,
)

RID = b"rid-1"


def test_upstream_drops_what_the_client_connection_names_and_the_gateway_namespace() -> None:
    client = [
        (b"content-type", b"application/json"),
        (b"connection", b"keep-alive, X-Private ,te"),
        (b"x-private", b"1"),
        (b"x-taogate-instance", b"forged"),
        (b"authorization", b"Bearer key"),
        (b"x-kept", b"yes"),
    ]
    out = upstream_headers(client, request_id=RID, tag=b"t")
    assert out == [
        (b"content-type", b"application/json"),
        (b"x-kept", b"yes"),
        (b"x-request-id", RID),
        (b"x-request-tag", b"t"),
    ]


def test_a_client_cannot_nominate_the_gateway_s_own_headers_away() -> None:
    out = upstream_headers([(b"connection", b"x-request-id, x-request-tag")], request_id=RID, tag=b"t")
    assert out == [(b"x-request-id", RID), (b"x-request-tag", b"t")]


def test_downstream_drops_origin_policies_hop_by_hop_and_forged_gateway_headers() -> None:
    raw = [
        (b"content-type", b"application/json"),
        (b"connection", b"close, X-Hop"),
        (b"x-hop", b"1"),
        (b"x-taogate-instance", b"forged"),
        (b"set-cookie", b"a=b"),
        (b"strict-transport-security", b"max-age=1"),
        (b"alt-svc", b'h3=":443"'),
        (b"proxy-authenticate", b"Basic"),
        (b"content-encoding", b"gzip"),
        (b"cache-control", b"no-store"),
        (b"www-authenticate", b"Bearer"),
    ]
    out = downstream_headers(raw, request_id=RID, instance="i0")
    assert out == [
        (b"content-type", b"application/json"),
        (b"content-encoding", b"gzip"),
        (b"cache-control", b"no-store"),
        (b"www-authenticate", b"Bearer"),
        (b"x-request-id", RID),
        (b"x-taogate-instance", b"i0"),
    ]


names = st.sampled_from(
    [b"a", b"b", b"x-taogate-x", b"connection", b"keep-alive", b"set-cookie", b"te", b"x-request-id"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(names, st.sampled_from([b"1", b"a, b", b"close", b"x-taogate-x"])), max_size=8))
def test_property_nothing_hop_by_hop_or_nominated_goes_either_way(headers: list[tuple[bytes, bytes]]) -> None:
    nominated = {
        t.strip() for k, v in headers if k == b"connection" for t in v.split(b",") if t.strip() != b"close"
    }
    for out in (
        upstream_headers(headers, request_id=RID, tag=None)[:-1],
        downstream_headers(headers, request_id=RID, instance="i")[:-2],
    ):
        sent = {k for k, _ in out}
        assert not sent & (HOP_BY_HOP | nominated)
        assert not any(k.startswith(b"x-taogate-") for k in sent)


def test_the_load_report_is_asked_of_instances_only_and_kept_from_the_client() -> None:
    forward = Forward(
        b"POST", b"/v1/completions", [(b"content-type", b"application/json")], b"{}", ask_load=True
    )
    asked, _ = forward.to(InstanceSpec("i0", "http://127.0.0.1:8000"))
    assert (b"endpoint-load-metrics-format", b"JSON") in asked
    hosted, _ = forward.to(InstanceSpec("overflow", "https://api.example", overflow=True))
    assert all(k != b"endpoint-load-metrics-format" for k, _ in hosted)  # someone else's service
    answer = [(b"content-type", b"application/json"), (b"endpoint-load-metrics", b"JSON {}")]
    kept = downstream_headers(answer, request_id=RID, instance="i0", drop_load=True)
    assert all(k != b"endpoint-load-metrics" for k, _ in kept)
    passed = downstream_headers(answer, request_id=RID, instance="i0")  # the client asked itself
    assert (b"endpoint-load-metrics", b"JSON {}") in passed


def test_x_forwarded_for_gets_the_client_address_appended_to_what_the_client_claims() -> None:
    claimed = [(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"10.0.0.1"), (b"x-kept", b"yes")]
    out = upstream_headers(claimed, request_id=RID, tag=None, client=("192.0.2.7", 5555))
    assert out == [
        (b"x-kept", b"yes"),
        (b"x-forwarded-for", b"6.6.6.6, 10.0.0.1, 192.0.2.7"),
        (b"x-request-id", RID),
    ]
    alone = upstream_headers([], request_id=RID, tag=None, client=("::1", 1))
    assert alone == [(b"x-forwarded-for", b"::1"), (b"x-request-id", RID)]
    # Picker mode: no client of ours; the list the gateway in front wrote goes on as it came.
    behind = upstream_headers(claimed, request_id=RID, tag=None)
    assert (b"x-forwarded-for", b"6.6.6.6, 10.0.0.1") in behind


def test_what_an_instance_runs_on_is_not_relayed() -> None:
    out = downstream_headers(
        [(b"X-Powered-By", b"PHP/5.4"), (b"x-kept", b"yes")], request_id=RID, instance="a"
    )
    assert (b"x-powered-by", b"PHP/5.4") not in out and (b"x-kept", b"yes") in out


def _upstream_by_definition(
    headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None
) -> list[tuple[bytes, bytes]]:
    """``upstream_headers`` as first written: every drop rule in one filter, X-Forwarded-For after."""
    drop = _DROP_UP | _nominated(headers)
    out = [(k, v) for k, v in headers if k not in drop and not k.startswith(b"x-taogate-")]
    hops = [v for k, v in headers if k == b"x-forwarded-for"]
    if client is not None:
        hops.append(client[0].encode())
    if hops:
        out.append((b"x-forwarded-for", b", ".join(hops)))
    return [*out, (b"x-request-id", RID)]


def _downstream_by_definition(
    headers: list[tuple[bytes, bytes]], drop_load: bool
) -> list[tuple[bytes, bytes]]:
    drop = (_DROP_DOWN_LOAD if drop_load else _DROP_DOWN) | _nominated(headers)
    out = [(k, v) for k, v in headers if k not in drop and not k.startswith(b"x-taogate-")]
    return [*out, (b"x-request-id", RID), (b"x-taogate-instance", b"i")]


every_name = st.sampled_from(
    [
        b"a",
        b"content-type",
        b"x-taogate-x",
        b"connection",
        b"keep-alive",
        b"authorization",
        b"x-forwarded-for",
        b"endpoint-load-metrics",
        b"server",
        b"x-request-id",
        b"x-request-tag",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(every_name, st.sampled_from([b"1", b"a, b", b"close", b"server, te", b"10.0.0.1"]))),
    st.sampled_from([None, ("127.0.0.9", 5000)]),
    st.booleans(),
)
def test_property_the_one_pass_filters_keep_exactly_what_the_rules_keep(
    headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None, drop_load: bool
) -> None:
    """The filters run in one pass (a Connection field's names dropped after): the same pairs, in the
    same order, as every rule applied at once."""
    assert upstream_headers(headers, request_id=RID, tag=None, client=client) == _upstream_by_definition(
        headers, client
    )
    assert downstream_headers(
        headers, request_id=RID, instance="i", drop_load=drop_load
    ) == _downstream_by_definition(headers, drop_load)
