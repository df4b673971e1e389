"""What one request did, filled in as it goes: the access log's line, the metrics, its key's tally.

The proxy (or the picker) fills it; accounting, the access log and the limiter read it. Never the
key (only its name), never a body.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    route: str
    started: float
    key: str | None = None  # the client key's name (never the key itself)
    model: str | None = None
    client_tag: str | None = None
    tag: str | None = None
    long: bool = False
    instance: str | None = None
    status: int = 500
    prompt_tokens_est: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served by the prefix cache; None: usage did not say
    ttfb: float | None = None
    duration: float = 0.0
    queue_wait: float = 0.0
    retries: int = 0
    channel_fallback: bool | None = None  # True: sent outside its long/short channel
    error: str | None = None
    reject: str | None = None
    priority: int | None = None  # the priority class, when not the default (0)
