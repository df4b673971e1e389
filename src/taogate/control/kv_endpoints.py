"""Where an instance's KV events are found: the address the gateway binds or connects to.

vLLM connects its PUB socket to a non-wildcard endpoint (``kv_events = "tcp://127.0.0.1:5557"`` on
the instance), so the gateway binds that address; to a wildcard, IPv6 or ipc one vLLM binds, and
the gateway connects: to a wildcard's port on the instance's own host (from its ``url``), as it
does to the replay socket, which vLLM always binds. pyzmq and msgpack are the ``precise`` extra
(``require_precise`` says at start and reload when they are missing).
"""

from __future__ import annotations

import importlib
from typing import Final
from urllib.parse import urlsplit

from taogate.dispatch.blocks import publisher_binds
from taogate.settings import ConfigError, Settings

__all__ = ["PRECISE_MODULES", "replay_endpoint", "require_precise", "subscriber_endpoint", "tcp_parts"]

_WILDCARDS: Final = frozenset({"*", "0.0.0.0", "[::]", "::"})
PRECISE_MODULES: Final = ("zmq", "msgpack")


def require_precise(settings: Settings) -> None:
    """ConfigError when an instance has ``kv_events`` and pyzmq or msgpack is not installed."""
    if not settings.kv_events:
        return
    for module in PRECISE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(
                f"kv_events needs the `{module}` package (precise prefix-cache dispatch): "
                "pip install 'taogate[precise]', or remove kv_events"
            ) from None


def tcp_parts(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a tcp:// endpoint, else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    return (host, port) if sep else None


def _on_instance_host(endpoint: str, url: str) -> str:
    """A wildcard's port on the instance's own host (a wildcard cannot be connected to)."""
    parts = tcp_parts(endpoint)
    host = urlsplit(url).hostname
    if parts is None or parts[0] not in _WILDCARDS or not host:
        return endpoint
    return f"tcp://[{host}]:{parts[1]}" if ":" in host else f"tcp://{host}:{parts[1]}"


def subscriber_endpoint(endpoint: str, url: str) -> tuple[bool, str]:
    """(connect, address): what the gateway's SUB socket does with an instance's ``kv_events``."""
    if publisher_binds(endpoint):
        return True, _on_instance_host(endpoint, url)
    return False, endpoint


def replay_endpoint(endpoint: str, url: str) -> str:
    """Where the gateway's DEALER connects: vLLM binds its replay ROUTER whatever the address."""
    return _on_instance_host(endpoint, url)
