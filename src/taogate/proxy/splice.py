"""Fields the gateway writes into a forwarded JSON body, without re-serialising the client's."""

from __future__ import annotations

__all__ = ["with_fields"]


def with_fields(body: bytes, fields: bytes) -> bytes:
    """``body`` (a JSON object) with ``fields`` (``"k":v`` pairs, comma-separated) written last,
    so they win over any earlier copy: JSON parsers keep the last of a repeated key, vLLM's too."""
    end = body.rstrip().rfind(b"}")
    head = body[:end].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + fields + b"}"
