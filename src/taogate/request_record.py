"""What one request did, filled in as it goes: the access log's line, the metrics, its key's tally.

The proxy (or the picker) fills it; accounting, the access log and the limiter read it. Never the
key (only its name), never a body.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestRecord"]


@dataclass(init=False, slots=True)
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
    stream: bool = False  # answered as a stream: its first byte is its first token

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        request_id: str,
        route: str,
        started: float,
        key: str | None = None,
        model: str | None = None,
        client_tag: str | None = None,
        tag: str | None = None,
        long: bool = False,
        instance: str | None = None,
        status: int = 500,
        prompt_tokens_est: int | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        ttfb: float | None = None,
        duration: float = 0.0,
        queue_wait: float = 0.0,
        retries: int = 0,
        channel_fallback: bool | None = None,
        error: str | None = None,
        reject: str | None = None,
        priority: int | None = None,
        stream: bool = False,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.started = started
        self.key = key
        self.model = model
        self.client_tag = client_tag
        self.tag = tag
        self.long = long
        self.instance = instance
        self.status = status
        self.prompt_tokens_est = prompt_tokens_est
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens
        self.ttfb = ttfb
        self.duration = duration
        self.queue_wait = queue_wait
        self.retries = retries
        self.channel_fallback = channel_fallback
        self.error = error
        self.reject = reject
        self.priority = priority
        self.stream = stream
