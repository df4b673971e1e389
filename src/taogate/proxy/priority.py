"""A request's priority class: where it comes from, its bounded label, and how it reaches vLLM.

The class is vLLM's own ``priority`` (an integer, lower is served first, 0 by default), taken from
an ``X-Priority`` header, else a client's ``X-Vllm-Priority`` header (which vLLM itself lets beat the
body), else the body's ``priority`` field. The gateway queue orders by it (``fleet.dispatcher``).

Upstream, only instances started with ``--scheduling-policy priority`` are told, since only there
does it change anything: on routes with a body field the value is written into the body, on the
Messages API (no field) it goes as ``X-Vllm-Priority``. The client's own ``X-Vllm-Priority`` never
goes upstream: the gateway decides what vLLM is told. vLLM 0.32 accepts a non-zero ``priority`` on
first-come-first-served instances and ignores it, so a body's own field is forwarded as it is
everywhere rather than rewritten for instances that would not act on it.

A class more urgent than the client key's ``max_priority`` (the ceiling) is lowered to it, not
refused: a priority is a scheduling hint, and a request that asks too much is still a request (as
OpenAI answers a ``service_tier`` an account does not have with the tier it has). What a priority
instance is told is then the ceiling, written after the body's own field so that it wins.
"""

from __future__ import annotations

from typing import Any, Final

from taogate.errors import BadRequest

__all__ = ["HEADER", "VLLM_HEADER", "priority_of", "resolve"]

HEADER: Final = b"x-priority"
VLLM_HEADER: Final = b"x-vllm-priority"
#: vLLM's range for the field (a signed 64-bit integer).
_LOW, _HIGH = -(2**63), 2**63 - 1


def _parse(value: object, where: str) -> int:
    """An integer as vLLM's lax validation reads one: ``5``, ``"5"``, ``5.0``, ``true``."""
    if isinstance(value, bytes):
        value = value.decode("latin-1").strip()
    number: int | None = None
    if isinstance(value, bool | int) or (isinstance(value, float) and value.is_integer()):
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    if number is None or not _LOW <= number <= _HIGH:
        raise BadRequest(
            f"{where} must be an integer (lower is served first), got {str(value)[:64]!r}.",
            code="invalid_priority",
            param="priority",
        )
    return number


def priority_of(header: bytes | None, vllm_header: bytes | None, payload: dict[str, Any] | None) -> int:
    """The request's class: ``X-Priority``, else ``X-Vllm-Priority``, else the body's field, else 0."""
    if header is not None:
        return _parse(header, "The X-Priority header")
    if vllm_header is not None:
        return _parse(vllm_header, "The X-Vllm-Priority header")
    if payload is not None:
        value = payload.get("priority")
        if value is not None:
            return _parse(value, "'priority'")
    return 0


def resolve(
    header: bytes | None,
    vllm_header: bytes | None,
    payload: dict[str, Any] | None,
    where: str,
    ceiling: int = 0,
) -> tuple[int, int | None]:
    """(the request's class, what a priority instance must be told, None when nothing): a class
    from a header is told unless the body already says it where vLLM reads it (``where``); a class
    more urgent than ``ceiling`` becomes ``ceiling``."""
    if header is None and vllm_header is None and (payload is None or "priority" not in payload):
        if ceiling <= 0:
            return 0, None  # the common case: the default class, nothing to tell
        return ceiling, None if where == "none" else ceiling
    own = priority_of(None, None, payload) if payload is not None and where != "none" else 0
    priority = own if header is None and vllm_header is None else priority_of(header, vllm_header, None)
    priority = max(priority, ceiling)
    if where == "none":
        return priority, None
    said = own if where == "body" else 0
    return priority, priority if priority != said else None
