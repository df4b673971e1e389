"""What one request sends upstream, and what only some instances are told.

The body and headers are the client's (minus credentials and hop-by-hop headers); per attempt,
since a retry may go elsewhere, the instance's own key is added, a priority instance is told the
request's class (``proxy.priority``), and a Responses request that named no id is given one that
names the instance (``proxy.responses``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import orjson

from taogate.errors import NotFound
from taogate.fleet.instance import Instance, InstanceSpec
from taogate.fleet.load_report import REQUEST_HEADER as LOAD_REPORT
from taogate.proxy.intake import Incoming
from taogate.proxy.multipart import StreamedBody
from taogate.proxy.priority import VLLM_HEADER
from taogate.proxy.responses import ResponseIds, checked_id
from taogate.proxy.routes import RESPONSE_ITEM_PREFIX, Route
from taogate.proxy.splice import with_fields
from taogate.proxy.upstream import downstream_headers

__all__ = ["Forward", "chosen_request_id", "plan", "stored_item"]


@dataclass(init=False, slots=True)
class Forward:
    """One request's upstream side: method, path, headers and body, and the per-instance parts."""

    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes | StreamedBody
    tell_priority: int | None = None  # the class to tell priority instances (None: nothing to tell)
    priority_in_body: bool = True  # where: the body's field, or X-Vllm-Priority
    ids: ResponseIds | None = None  # a Responses request's ids are minted or remembered here
    mint: bool = False  # give the response an id that names its instance
    chosen_id: str | None = None  # the id the client chose: remembered once the answer is in
    # Ask a vLLM instance for its load with the answer (fresher than a scrape); the client did not
    # ask, so the answer's header is the gateway's alone (``downstream_headers(drop_load=...)``).
    ask_load: bool = False
    id_aliases: tuple[bytes, ...] = ()  # the route's other names for x-request-id (``ErrorShape``)
    # The stream's usage was asked for by the gateway, not the client: its usage-only last chunk
    # is kept from the client (``relay``), who did not ask for a chunk with no choices.
    hide_usage: bool = False

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | StreamedBody,
        tell_priority: int | None = None,
        priority_in_body: bool = True,
        ids: ResponseIds | None = None,
        mint: bool = False,
        chosen_id: str | None = None,
        ask_load: bool = False,
        id_aliases: tuple[bytes, ...] = (),
        hide_usage: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.tell_priority = tell_priority
        self.priority_in_body = priority_in_body
        self.ids = ids
        self.mint = mint
        self.chosen_id = chosen_id
        self.ask_load = ask_load
        self.id_aliases = id_aliases
        self.hide_usage = hide_usage

    def answer_headers(
        self, raw: Sequence[tuple[bytes, bytes]], request_id: bytes, instance: str, receipt: str | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The answer's headers for the client (``downstream_headers``), with the route receipt if any."""
        out = downstream_headers(raw, request_id=request_id, instance=instance, drop_load=self.ask_load)
        for name in self.id_aliases:
            out.append((name, request_id))
        if receipt:
            out.append((b"x-taogate-route", receipt.encode("ascii", "replace")))
        return out

    def to(self, spec: InstanceSpec) -> tuple[list[tuple[bytes, bytes]], bytes | StreamedBody]:
        headers, body = self.headers, self.body
        if self.ask_load and not spec.overflow:  # the overflow channel is someone else's service
            headers = [*headers, LOAD_REPORT]
        if self.tell_priority is None and not self.mint and not spec.api_key:
            return headers, body  # the common case: nothing to add
        if spec.api_key:
            headers = [*headers, (b"authorization", b"Bearer " + spec.api_key.encode())]
        fields: list[bytes] = []
        told = self.tell_priority
        if told is not None and spec.priority:
            if self.priority_in_body:
                fields.append(b'"priority":' + str(told).encode())
            else:
                headers = [*headers, (VLLM_HEADER, str(told).encode())]
        if self.mint and self.ids is not None:
            fields.append(b'"request_id":"' + self.ids.mint(spec.name).encode() + b'"')
        if fields and isinstance(body, bytes):
            body = with_fields(body, b",".join(fields))
        return headers, body

    @property
    def reading(self) -> bool:
        """Whether the client's body is still arriving (its ``receive`` is the body's)."""
        return isinstance(self.body, StreamedBody) and not self.body.done

    @property
    def replayable(self) -> bool:
        """Whether another attempt can send the body again (a streamed one only before it started)."""
        return not isinstance(self.body, StreamedBody) or not self.body.started

    def succeeded(self, instance: str) -> None:
        if self.chosen_id is not None and self.ids is not None:
            self.ids.remember(self.chosen_id, instance)


_ITEM_HEAD = RESPONSE_ITEM_PREFIX.strip("/").split("/")  # ["v1", "responses"]


#: Streams whose usage comes only when asked for (``stream_options.include_usage``), which the
#: OpenAI SDK does not ask by default: without it, a streamed answer's tokens are counted nowhere
#: (its key's limits, metrics, the access log).
_USAGE_ASKED = frozenset({"chat", "completions"})


def _usage_asked(payload: dict[str, Any] | None, body: bytes) -> tuple[bytes, bool]:
    """The body with ``include_usage`` asked for, merged into the client's own ``stream_options``,
    and whether the gateway asked (then the usage-only chunk is the gateway's, not the client's).
    Options that are not an object are left to the instance to refuse."""
    options = payload.get("stream_options") if payload is not None else None
    if options is None:
        options = {}
    elif not isinstance(options, dict) or options.get("include_usage") is True:
        return body, False
    merged = orjson.dumps({**options, "include_usage": True})
    return with_fields(body, b'"stream_options":' + merged), True


def stored_item(scope: dict[str, Any], prefix: str) -> tuple[str, bytes]:
    """The response id of ``/v1/responses/{id}`` or ``.../{id}/cancel``, under the gateway's
    ``prefix`` or not, and that path upstream without the prefix. Segments are compared decoded, as
    the route was matched (``%72esponses`` is ``responses``); the id's segment and what follows go
    upstream as the client encoded them. NotFound for other paths."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode()
    raw_parts = raw.decode("latin-1").split("/")
    parts = [unquote(part) for part in raw_parts]
    heads = [["", *prefix.strip("/").split("/"), *_ITEM_HEAD]] if prefix else []
    for head in [*heads, ["", *_ITEM_HEAD]]:
        rest = parts[len(head) :]
        if parts[: len(head)] == head and rest and rest[0] and rest[1:] in ([], ["cancel"]):
            path = RESPONSE_ITEM_PREFIX + "/".join(raw_parts[len(head) :])
            return rest[0], path.encode("latin-1")
    raise NotFound(f"Unknown path {scope['path']}.")


def chosen_request_id(payload: dict[str, Any]) -> str | None:
    """The response id the client chose, if any (a 400 past ``MAX_ID_BYTES``)."""
    value = payload.get("request_id")
    return checked_id(value) if isinstance(value, str) and value else None


def plan(
    route: Route,
    scope: dict[str, Any],
    prefix: str,
    headers: list[tuple[bytes, bytes]],
    incoming: Incoming,
    *,
    ids: ResponseIds,
    fleet: Iterable[Instance],
    ask_usage: bool = False,
) -> tuple[Forward, frozenset[str]]:
    """The request's upstream side, and the instances it must not go to (all but the one that holds
    the stored response it is about, when there is one). ``ask_usage``: a stream is asked for its
    usage, the relay keeping the chunk from the client (``serve``; in picker mode Envoy relays)."""
    item: str | None = None
    if route.body == "none":
        item, path = stored_item(scope, prefix)
    else:
        path = route.upstream_path
    query: bytes = scope.get("query_string", b"")
    if query:
        path += b"?" + query
    # Unless the client asked for the report itself (a list of names: cheaper than a generator).
    ask_load = route.generates and not incoming.facts.stream and LOAD_REPORT[0] not in [k for k, _ in headers]
    body: bytes | StreamedBody = incoming.body
    hide_usage = False
    if ask_usage and route.kind in _USAGE_ASKED and incoming.facts.stream:
        body, hide_usage = _usage_asked(incoming.payload, incoming.body)
    if incoming.upload is not None:
        body = incoming.upload
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            headers = [*headers, (b"content-length", length)]
    forward = Forward(
        scope["method"].encode(),
        path,
        headers,
        body,
        incoming.tell_priority,
        route.priority == "body",
        ask_load=ask_load,
        id_aliases=route.errors.request_id_aliases,
        hide_usage=hide_usage,
    )
    owner: str | None = None
    instances: list[str] = []
    if item is not None:
        instances = [i.name for i in fleet]
        owner = ids.owner(item, instances)
    elif route.kind == "responses" and incoming.payload is not None:
        payload = incoming.payload
        previous = payload.get("previous_response_id")
        if isinstance(previous, str) and previous:
            instances = [i.name for i in fleet]
            owner = ids.owner(previous, instances)
        forward.ids = ids
        forward.chosen_id = chosen_request_id(payload)
        forward.mint = forward.chosen_id is None
    exclude = frozenset(i for i in instances if i != owner) if owner is not None else frozenset()
    return forward, exclude
