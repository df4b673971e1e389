"""The proxied routes: where each goes upstream and what the gateway reads from its body."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from taogate.errors import OPENAI_ERRORS, ErrorShape
from taogate.proxy import anthropic, responses, usage
from taogate.proxy.shapes import batch_view, invocation_view, pooling_view

__all__ = ["RESPONSE_ITEM", "RESPONSE_ITEM_PREFIX", "ROUTES", "Route", "RouteKind", "error_shapes"]

RouteKind = Literal[
    "chat",
    "completions",
    "embeddings",
    "responses",
    "response_item",
    "tokenize",
    "detokenize",
    "messages",
    "count_tokens",
    "chat_batch",
    "invocations",
    "pooling",
    "score",
    "rerank",
    "classify",
    "audio",
]

#: How a body reads as a shape dispatch measures: (shape, the body as that shape).
View = Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]
#: (prompt tokens, output tokens, cached tokens) from an answer's ``usage`` object.
UsageCounts = Callable[[dict[str, Any] | None], tuple[int | None, int | None, int | None]]

_POST = frozenset({"POST"})


@dataclass(frozen=True, slots=True)
class Route:
    """A proxied route: where it is upstream and what it needs from the body.

    ``priority`` says where vLLM reads a request's priority on it: its ``priority`` body field, the
    ``X-Vllm-Priority`` header only (the Messages API has no such field), or nowhere."""

    path: str  # upstream path, e.g. /v1/chat/completions
    kind: RouteKind
    model_required: bool = True
    generates: bool = True  # produces tokens (TTFT and speed samples make sense)
    metered: bool = True  # its tokens count against a key's token limits (not counting, tokenizing)
    errors: ErrorShape = OPENAI_ERRORS  # how the gateway's own errors look on this route
    anthropic: bool = False  # the key may come as x-api-key; usage in Anthropic's fields
    view: View | None = None  # None: the body is measured as ``kind``
    priority: Literal["body", "header", "none"] = "body"
    body: Literal["json", "multipart", "none"] = "json"
    methods: frozenset[str] = _POST
    usage: UsageCounts = usage.usage_counts  # the counts in this API's usage object

    @property
    def upstream_path(self) -> bytes:
        return self.path.encode()


def _anthropic(path: str, kind: RouteKind, *, generates: bool, priority: Literal["header", "none"]) -> Route:
    return Route(
        path,
        kind,
        generates=generates,
        metered=generates,  # count_tokens is free of token limits, as Anthropic's own is
        errors=anthropic.ANTHROPIC_ERRORS,
        anthropic=True,
        view=anthropic.chat_view,
        priority=priority,
        usage=anthropic.usage_counts,
    )


def _pooling(path: str, kind: RouteKind) -> Route:
    return Route(path, kind, model_required=False, generates=False, view=pooling_view)


def _audio(path: str) -> Route:
    return Route(path, "audio", model_required=False, generates=False, priority="none", body="multipart")


ROUTES: tuple[Route, ...] = (
    Route("/v1/chat/completions", "chat"),
    Route("/v1/completions", "completions"),
    Route("/v1/embeddings", "embeddings", generates=False),
    Route("/v1/responses", "responses", errors=responses.RESPONSES_ERRORS, usage=responses.usage_counts),
    Route("/tokenize", "tokenize", model_required=False, generates=False, metered=False, priority="none"),
    Route("/detokenize", "detokenize", model_required=False, generates=False, metered=False, priority="none"),
    _anthropic("/v1/messages", "messages", generates=True, priority="header"),
    _anthropic("/v1/messages/count_tokens", "count_tokens", generates=False, priority="none"),
    Route("/v1/chat/completions/batch", "chat_batch", model_required=False, generates=False, view=batch_view),
    Route("/invocations", "invocations", model_required=False, generates=False, view=invocation_view),
    _pooling("/pooling", "pooling"),
    _pooling("/classify", "classify"),
    _pooling("/score", "score"),
    _pooling("/v1/score", "score"),
    _pooling("/rerank", "rerank"),
    _pooling("/v1/rerank", "rerank"),
    _pooling("/v2/rerank", "rerank"),
    _audio("/v1/audio/transcriptions"),
    _audio("/v1/audio/translations"),
)

#: ``/v1/responses/{id}`` (GET, DELETE) and ``/v1/responses/{id}/cancel`` (POST): sent to the
#: instance that holds the response; the upstream path is the request's own.
RESPONSE_ITEM_PREFIX = "/v1/responses/"
RESPONSE_ITEM = Route(
    RESPONSE_ITEM_PREFIX,
    "response_item",
    model_required=False,
    generates=False,
    priority="none",
    body="none",
    methods=frozenset({"GET", "POST", "DELETE"}),
)


def error_shapes(prefix: str) -> Callable[[str], ErrorShape]:
    """How the gateway's own errors look at a path, routed or not: a route's shape at its path and
    below it (an Anthropic client asking for ``/v1/messages/batches`` reads Anthropic's 404), else
    OpenAI's. ``prefix``: ``base_url``'s path, under which the routes are served too."""
    roots = tuple(
        (base + route.path, route.errors)
        for route in ROUTES
        if route.errors is not OPENAI_ERRORS
        for base in dict.fromkeys(("", prefix))
    )

    def shape_at(path: str) -> ErrorShape:
        for root, shape in roots:
            if path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
                return shape
        return OPENAI_ERRORS

    return shape_at
