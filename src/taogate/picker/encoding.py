"""The ext_proc answers the picker sends, and the headers it reads, as protobuf messages.

Every message is built here, so the rest of the package speaks in bytes and tuples. A body handed
back in full-duplex mode goes in chunks of at most ``CHUNK`` bytes: some gateways cap a streamed
chunk at 64 KiB.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from taogate.picker.names import DESTINATION

__all__ = [
    "CHUNK",
    "LB_NAMESPACE",
    "Headers",
    "body_chunks",
    "body_echo",
    "body_mode_problem",
    "decode_headers",
    "headers_answer",
    "immediate",
    "pick_answer",
    "trailers_answer",
]

#: The dynamic metadata's namespace the pick is written under (``names.DESTINATION``: its keys).
LB_NAMESPACE = "envoy.lb"
_PICKED = tuple(name.encode() for name in DESTINATION)
CHUNK = 62_000

Headers = list[tuple[bytes, bytes]]
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def decode_headers(message: Any) -> Headers:
    """An ``HttpHeaders`` message as ASGI-style pairs (lower-case names, raw values; the
    pseudo-headers ``:path``, ``:method``... included)."""
    return [
        (h.key.encode("latin-1"), h.raw_value if h.raw_value else h.value.encode("latin-1"))
        for h in message.headers.headers
    ]


def _mutation(set_headers: Iterable[tuple[bytes, bytes]], remove: Iterable[bytes] = ()) -> Any:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k.decode("latin-1"), raw_value=v), append_action=_OVERWRITE
            )
            for k, v in set_headers
        ],
        remove_headers=[k.decode("latin-1") for k in remove],
    )


def body_mode_problem(message: Any) -> str | None:
    """The request body mode the gateway in front announced on the stream's first message when it is
    not full-duplex (the picker reads the body to pick and hands it back as it streams: in another
    mode the gateway waits for the headers' answer the picker keeps until the body), else None
    (also when nothing was announced)."""
    if not message.HasField("protocol_config"):
        return None
    mode = message.protocol_config.request_body_mode
    if mode == _FULL_DUPLEX:
        return None
    return str(processing_mode_pb2.ProcessingMode.BodySendMode.Name(mode))


def pick_answer(endpoints: Sequence[str], set_headers: Headers, remove: Sequence[bytes]) -> Any:
    """The answer to the request headers: the destination (an ordered list, the first preferred) in
    the headers and ``envoy.lb`` metadata keys of ``names.DESTINATION``, the upstream header
    changes, and a cleared route cache so that routing sees the new header."""
    value = ",".join(endpoints)
    raw = value.encode()
    headers = [*((name, raw) for name in _PICKED), *set_headers]
    metadata = struct_pb2.Struct()
    lb = metadata.fields[LB_NAMESPACE].struct_value
    for name in DESTINATION:
        lb.fields[name].string_value = value
    common = pb.CommonResponse(header_mutation=_mutation(headers, remove), clear_route_cache=True)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def body_chunks(body: bytes, *, end: bool, response: bool = False) -> Iterator[Any]:
    """The body handed back in full-duplex mode, in chunks; ``end``: the last one ends the stream."""
    field = "response_body" if response else "request_body"
    for at in range(0, max(len(body), 1), CHUNK):
        part = body[at : at + CHUNK]
        last = end and at + CHUNK >= len(body)
        streamed = pb.StreamedBodyResponse(body=part, end_of_stream=last)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        yield pb.ProcessingResponse(**{field: pb.BodyResponse(response=common)})


def body_echo(chunk: bytes, end: bool) -> Any:
    """One response chunk passed on unchanged (full-duplex mode: each must be handed back)."""
    streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=end)
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def headers_answer(set_headers: Headers, remove: Sequence[bytes] = ()) -> Any:
    """The answer to the response headers: what the client is told (and not told)."""
    common = pb.CommonResponse(header_mutation=_mutation(set_headers, remove))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def trailers_answer(*, response: bool) -> Any:
    field = "response_trailers" if response else "request_trailers"
    return pb.ProcessingResponse(**{field: pb.TrailersResponse()})


def immediate(status: int, headers: Headers, body: bytes, details: str) -> Any:
    """An answer the gateway sends the client itself, without an upstream (errors, refusals)."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(headers),
            body=body,
            details=details,
        )
    )
