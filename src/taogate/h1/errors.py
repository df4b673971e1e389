"""How a hop to an instance failed (``upstream.translate`` maps each onto a retry decision)."""

from __future__ import annotations

__all__ = ["ConnectError", "ConnectTimeout", "Disconnected", "H1Error", "PoolTimeout", "ReadTimeout"]


class H1Error(Exception):
    """A failed hop; the subclass says how."""


class ConnectError(H1Error):
    """No connection: refused, unreachable, name not resolved. Nothing was sent."""


class ConnectTimeout(H1Error):
    """No connection within the connect timeout."""


class PoolTimeout(H1Error):
    """Every connection of the pool stayed in use for ``pool_timeout``: our limit, not the instance."""


class Disconnected(H1Error):
    """The connection closed, or the reply was malformed, before the answer was complete."""


class ReadTimeout(H1Error):
    """The instance sent nothing for longer than the read timeout."""
