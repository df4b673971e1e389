"""The proxied routes: where each goes upstream and what the gateway reads from its body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from taogate.errors import OPENAI_ERRORS, ErrorShape

__all__ = ["ROUTES", "Route", "RouteKind"]

RouteKind = Literal["chat", "completions", "embeddings", "responses", "tokenize", "detokenize"]


@dataclass(frozen=True, slots=True)
class Route:
    """A proxied route: where it is upstream and what it needs from the body."""

    path: str  # upstream path, e.g. /v1/chat/completions
    kind: RouteKind
    model_required: bool = True
    generates: bool = True  # produces tokens (TTFT and speed samples make sense)
    errors: ErrorShape = OPENAI_ERRORS  # how the gateway's own errors look on this route

    @property
    def upstream_path(self) -> bytes:
        return self.path.encode()


ROUTES: tuple[Route, ...] = (
    Route("/v1/chat/completions", "chat"),
    Route("/v1/completions", "completions"),
    Route("/v1/embeddings", "embeddings", generates=False),
    Route("/v1/responses", "responses"),
    Route("/tokenize", "tokenize", model_required=False, generates=False),
    Route("/detokenize", "detokenize", model_required=False, generates=False),
)
