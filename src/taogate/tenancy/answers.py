"""How a key's limits answer, as OpenAI's do: the ``x-ratelimit-*`` headers, and the 429 with
code ``rate_limit_exceeded``, ``type`` requests or tokens, its message and ``Retry-After``."""

from __future__ import annotations

import math

from mypy_extensions import mypyc_attr

from taogate.errors import GatewayError
from taogate.tenancy.keys import Tenant
from taogate.tenancy.window import Counts, duration, reset_after, used, wait_for

__all__ = ["RateLimited", "rate_headers", "refusal"]


@mypyc_attr(native_class=False)
class RateLimited(GatewayError):
    """429 ``rate_limit_exceeded``, typed ``requests`` or ``tokens`` as OpenAI types it, with the
    key's rate-limit headers and ``Retry-After`` (also in ms, which the OpenAI SDK prefers)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(
        self, message: str, kind: str, wait: float | None, headers: list[tuple[bytes, bytes]]
    ) -> None:
        super().__init__(message, retry_after=None if wait is None else max(1, math.ceil(wait)))
        self.type = kind
        self._wait = wait
        self._extra = headers

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [*super().headers(), *self._extra]
        if self._wait is not None:
            out.append((b"retry-after-ms", str(max(1, math.ceil(self._wait * 1000))).encode()))
        return out


def rate_headers(tenant: Tenant, counts: Counts, window: float) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for the limits it has."""
    out: list[tuple[bytes, bytes]] = []
    for kind, limit, prev, cur in (
        (b"requests", tenant.requests_per_minute, counts.req_prev, counts.req_cur),
        (b"tokens", tenant.tokens_per_minute, counts.tok_prev, counts.tok_cur),
    ):
        if limit is None:
            continue
        left = max(0, math.floor(limit - used(prev, cur, counts.frac)))
        reset = duration(reset_after(prev, cur, counts.frac, window))
        out.append((b"x-ratelimit-limit-" + kind, str(limit).encode()))
        out.append((b"x-ratelimit-remaining-" + kind, str(left).encode()))
        out.append((b"x-ratelimit-reset-" + kind, reset.encode()))
    return out


def refusal(tenant: Tenant, counts: Counts, cost: int, window: float) -> RateLimited:
    """Which limit refused, as OpenAI words it, and when the request would fit."""
    headers = rate_headers(tenant, counts, window)
    rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
    f = counts.frac
    if rpm is not None and used(counts.req_prev, counts.req_cur, f) + 1 > rpm:
        kind, limit, now, asked = "requests", rpm, used(counts.req_prev, counts.req_cur, f), 1
        wait = wait_for(counts.req_prev, counts.req_cur, f, window, limit=rpm, cost=1)
    else:
        assert tpm is not None
        kind, limit, now, asked = "tokens", tpm, used(counts.tok_prev, counts.tok_cur, f), cost
        wait = wait_for(counts.tok_prev, counts.tok_cur, f, window, limit=tpm, cost=cost)
    when = (
        f"Please try again in {duration(wait)}."
        if wait is not None
        else "This request alone is over the limit: lower max_tokens or the prompt."
    )
    return RateLimited(
        f"Rate limit reached for key {tenant.name} on {kind} per {duration(window)}: Limit {limit}, "
        f"Used {math.ceil(now)}, Requested {asked}. {when}",
        kind,
        wait,
        headers,
    )
