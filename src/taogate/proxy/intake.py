"""Reading one request: its body, once, within the size limit, and the facts dispatch needs.

The body bytes are forwarded as they came; the parsed JSON is only read (model, stream flag, prompt
text for the size estimate and the prefix key). Only a route's model rewrite serialises it again,
and ``forward`` splices a field or two (``priority``, ``request_id``) into the bytes where needed.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from starlette.types import Receive

from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.prefix import shared_prefix
from taogate.dispatch.prefix_chains import PromptChain
from taogate.dispatch.token_ids import PromptTokenizer
from taogate.dispatch.tokens import ExactCounter, PromptSize, prompt_size
from taogate.dispatch.types import RequestFacts
from taogate.errors import BadRequest, BodyTooLarge, UnsupportedEncoding
from taogate.proxy.auth import header
from taogate.proxy.deadlines import Deadlines
from taogate.proxy.multipart import ClientLeft, StreamedBody, late
from taogate.proxy.priority import HEADER, VLLM_HEADER, resolve
from taogate.proxy.routes import Route
from taogate.settings import Settings


async def read_body(
    receive: Receive, limit: int, content_length: bytes | None, within: float, deadlines: Deadlines
) -> bytes:
    """The whole request body, or BodyTooLarge as soon as it is known to exceed ``limit``, or
    RequestTimeout when it is not all in ``within`` seconds (a trickled body would hold its
    memory and its connection for as long as the client likes)."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest("Content-Length is not a number.", code="invalid_content_length") from None
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    task = deadlines.start(within)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if deadlines.expired(task) and task.uncancel() == 0:
            raise late(within) from None
        raise
    finally:
        deadlines.done(task)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(
        f"Request body exceeds {limit} bytes ([gateway] max_body_bytes).", param=None, code="body_too_large"
    )


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent to it."""


class ClientStalled(ClientGone):
    """The client keeps its connection open but stopped reading: the gateway drops it."""


def request_id(raw: bytes | None) -> bytes:
    """The client's X-Request-Id when it is a sane token (it goes upstream and into logs), else a new one."""
    if raw and len(raw) <= 128 and raw.isascii() and raw.replace(b"-", b"").replace(b"_", b"").isalnum():
        return raw
    return os.urandom(12).hex().encode()


def parse_json_object(body: bytes, max_items: int = 1_000_000) -> dict[str, Any]:
    """The body as a JSON object. Parsing costs an allocation per value, so a body of millions of
    tiny ones would block the loop for a second or more: past ``max_items`` values (counted by the
    body's commas, those inside strings too: a bound on the parse, not an exact count) it is refused
    before it is parsed."""
    if not body:
        raise BadRequest("The request body is empty; send a JSON object.", code="invalid_json")
    if len(body) > max_items and body.count(b",") >= max_items:
        raise BadRequest(
            f"The request body holds more than {max_items} JSON values ([gateway] max_json_items).",
            code="too_many_items",
        )
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    return payload


#: How deep the gateway's own reading of a body goes: orjson parses 1,024 levels but writes 254.
MAX_DEPTH: Final = 254


class _NestingBound:
    """The gateway's own reading of a parsed body (views, size, prefix key, precise blocks): a part
    it serialises or walks that nests deeper than ``MAX_DEPTH`` is the client's 400, not a 500. The
    rule is checked where the depth is met, so a normal body pays nothing for it (a plain context
    manager: contextlib's generator-based one cost a generator and three calls per request)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is not None and issubclass(kind, (orjson.JSONEncodeError, RecursionError)):
            raise BadRequest(
                f"The request body nests JSON deeper than {MAX_DEPTH} levels.", code="too_deeply_nested"
            ) from None


#: ``with nesting_bound:`` around the gateway's own reading of a parsed body.
nesting_bound: Final = _NestingBound()


def model_of(route: Route, payload: dict[str, Any]) -> str | None:
    model = payload.get("model")
    if model is None:
        if route.model_required:
            raise BadRequest("You must provide a model parameter.", code="missing_model", param="model")
        return None
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string.", code="invalid_model", param="model")
    return model


#: Where a request's output limit may be, the first not null wins: chat's newer name, the older one
#: (completions, Anthropic), the Responses API's.
_LIMITS: Final = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def output_limit(payload: dict[str, Any]) -> int | None:
    """The request's output limit in tokens, None if it sets none (or not as an integer, which the
    engine answers itself). A negative one is refused here: a key's token limit reserves it."""
    for name in _LIMITS:
        value = payload.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        if value < 0:
            raise BadRequest(f"'{name}' must not be negative, got {value}.", param=name)
        return value
    return None


def request_facts(
    route: Route,
    payload: dict[str, Any],
    model: str | None,
    *,
    tokens: TokenEstimator,
    settings: Settings,
    exact: ExactCounter | None = None,
    priority: int = 0,
) -> tuple[RequestFacts, PromptSize]:
    """What dispatch needs to know about one request: size (calibrated estimate), long or not,
    shared-prefix key and what it covers (with a plain prompt's chain of blocks after it), stream
    flag, output limit. Also returns the size features for calibration."""
    kind, seen = route.view(payload) if route.view is not None else (route.kind, payload)
    size = prompt_size(kind, seen, exact)
    estimate = tokens.estimate(model, size)
    shared = shared_prefix(kind, seen) if settings.dispatch.prefix_affinity else None
    chain = None
    if shared is not None and shared.chain:
        chain = PromptChain(shared, functools.partial(tokens.estimate, model))
    limit = output_limit(payload)
    return (
        RequestFacts(
            model=model,
            prompt_tokens=estimate,
            long=estimate > settings.prefill.long_input_threshold,
            prefix_key=shared.key if shared else None,
            prefix_tokens=tokens.estimate(model, shared.size) if shared else 0,
            stream=payload.get("stream") is True,
            max_tokens=limit,
            priority=priority,
            chain=chain,
        ),
        size,
    )


#: The request headers ``Intake.read`` looks at, by their place in what ``_heads`` returns.
_HEADS: Final = {
    b"content-encoding": 0,
    b"content-length": 1,
    HEADER: 2,
    VLLM_HEADER: 3,
    b"x-taogate-route": 4,
    b"x-request-tag": 5,
}


def _uncompressed(encoding: bytes | None, what: str) -> None:
    """UnsupportedEncoding (415) unless the body comes without a content coding."""
    if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding.decode('latin-1')[:64]!r} is not accepted: send the {what} "
            "uncompressed."
        )


def _heads(
    headers: list[tuple[bytes, bytes]],
) -> tuple[bytes | None, bytes | None, bytes | None, bytes | None, bytes | None, bytes | None]:
    """The first value of each of ``_HEADS`` (None where absent), in one pass over the headers:
    Content-Encoding, Content-Length, X-Priority, X-Vllm-Priority, X-Taogate-Route, X-Request-Tag."""
    found: list[bytes | None] = [None, None, None, None, None, None]
    for k, v in headers:
        at = _HEADS.get(k)
        if at is not None and found[at] is None:
            found[at] = v
    return found[0], found[1], found[2], found[3], found[4], found[5]


@dataclass(init=False, slots=True)
class Incoming:
    """What the pipeline needs of one request, read once from its headers and body (and only read
    after: not frozen, as a frozen dataclass pays a ``object.__setattr__`` call per field to build)."""

    body: bytes  # forwarded as it came (but for a model rewrite)
    model: str | None
    facts: RequestFacts
    size: PromptSize  # the size features, for calibrating the estimate from usage
    tag: bytes | None  # X-Request-Tag upstream: the client's own, plus the long-input tag
    payload: dict[str, Any] | None = None  # the JSON body, read only
    tell_priority: int | None = None  # what a priority instance is told (proxy.priority)
    upload: StreamedBody | None = None  # a body streamed upstream as it arrives

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        body: bytes,
        model: str | None,
        facts: RequestFacts,
        size: PromptSize,
        tag: bytes | None,
        payload: dict[str, Any] | None = None,
        tell_priority: int | None = None,
        upload: StreamedBody | None = None,
    ) -> None:
        self.body = body
        self.model = model
        self.facts = facts
        self.size = size
        self.tag = tag
        self.payload = payload
        self.tell_priority = tell_priority
        self.upload = upload


#: Bodies above this are tokenized and hashed (precise mode) in a thread, off the event loop.
THREAD_BYTES = 16 << 10

#: (block sizes of the KV-event indexes in use, tokens worth hashing): see ``Gateway._precise_scope``.
PreciseScope = Callable[[], tuple[tuple[int, ...], int]]


class Intake:
    """Reads a request's body and facts under the settings in force (``configure`` on reload)."""

    def __init__(
        self,
        settings: Settings,
        tokens: TokenEstimator,
        exact: ExactCounter | None,
        *,
        blocks: PromptTokenizer | None = None,
        scope: PreciseScope | None = None,
    ) -> None:
        self._settings = settings
        self.tokens = tokens
        self._exact = exact
        self._deadlines = Deadlines()  # the body reads'
        self._blocks = blocks  # precise prefix-cache dispatch: the request's own token ids
        self._scope = scope

    async def read(
        self,
        route: Route,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        ceiling: int = 0,
        rewrite: str | None = None,
    ) -> Incoming:
        """``ceiling``: the most urgent priority class the client's key may claim; ``rewrite``: the
        model the gateway in front names in place of a JSON body's own (picker mode), written into
        the body that goes on."""
        if route.body == "multipart":  # a form is read for its model field as it came: uncompressed
            _uncompressed(header(headers, b"content-encoding"), "form")
            return await self.read_upload(headers, receive, ceiling)
        settings = self._settings
        encoding, length, ours, theirs, receipt, client_tag = _heads(headers)
        _uncompressed(encoding, "JSON body")
        g = settings.gateway
        body = await read_body(receive, g.max_body_bytes, length, g.body_timeout, self._deadlines)
        if route.body == "none":
            priority = resolve(ours, theirs, None, "none", ceiling)[0]
            facts = RequestFacts(None, 1, False, priority=priority)
            return Incoming(body, None, facts, PromptSize(), self._tag(client_tag, False))
        payload = parse_json_object(body, g.max_json_items)
        if rewrite is not None:
            payload["model"] = rewrite
            body = orjson.dumps(payload)
        model = model_of(route, payload)
        priority, tell = resolve(ours, theirs, payload, route.priority, ceiling)
        with nesting_bound:
            facts, size = request_facts(
                route,
                payload,
                model,
                tokens=self.tokens,
                settings=settings,
                exact=self._exact,
                priority=priority,
            )
            # ``X-Taogate-Route: 1`` on the request, or ``[dispatch] route_receipt`` for every request
            facts.receipt = settings.dispatch.route_receipt or (receipt or b"").strip() == b"1"
            if self._blocks is not None and self._scope is not None and facts.prefix_key is not None:
                sizes, cap = self._scope()  # precise mode's hook: vLLM's block hashes of the prompt
                if sizes:
                    make = self._blocks.blocks
                    if len(body) > THREAD_BYTES:
                        facts.blocks = await asyncio.to_thread(make, route.kind, payload, sizes, cap)
                    else:
                        facts.blocks = make(route.kind, payload, sizes, cap)
        return Incoming(body, model, facts, size, self._tag(client_tag, facts.long), payload, tell)

    @staticmethod
    def _classes(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
        """X-Priority and X-Vllm-Priority, in one pass over the headers."""
        _, _, ours, theirs, _, _ = _heads(headers)
        return ours, theirs

    def _tag(self, client_tag: bytes | None, long: bool) -> bytes | None:
        """X-Request-Tag upstream: the client's own (cut to 128 bytes), plus the long-input tag."""
        tag = client_tag[:128] if client_tag else None
        if long:
            long_tag = self._settings.prefill.tag.encode()
            tag = tag + b"," + long_tag if tag else long_tag
        return tag

    async def read_upload(
        self, headers: list[tuple[bytes, bytes]], receive: Receive, ceiling: int = 0
    ) -> Incoming:
        """A multipart form: only its head, for the ``model`` field (``proxy.multipart``)."""
        limit = self._settings.gateway.max_body_bytes
        declared = header(headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        upload = StreamedBody(receive, limit, self._settings.gateway.body_timeout)
        try:
            model = await upload.read_model(header(headers, b"content-type"))
        except ClientLeft:
            raise ClientGone from None
        priority = resolve(*self._classes(headers), None, "none", ceiling)[0]
        facts = RequestFacts(model, 1, False, priority=priority)
        client_tag = header(headers, b"x-request-tag")
        return Incoming(b"", model, facts, PromptSize(), self._tag(client_tag, False), upload=upload)
