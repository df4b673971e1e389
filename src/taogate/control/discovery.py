"""Instances from DNS: every address a name resolves to is an instance, re-resolved periodically.

For a Kubernetes headless Service (one A record per vLLM pod), or any name with several records.
Addresses that appear join the fleet (probed before they take work); addresses that disappear stop
taking new work and finish what they hold (see ``Fleet.apply``), so membership changes drop nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping

from taogate.fleet.fleet import instance_key
from taogate.fleet.instance import InstanceSpec
from taogate.instance_settings import DiscoverySettings
from taogate.settings import Settings

__all__ = ["Discovery", "Resolver", "discovered_specs", "system_resolver"]

log = logging.getLogger("taogate.health")

#: (host, port) → the addresses it resolves to; injectable so tests need no DNS server.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's resolver (the loop's getaddrinfo, which blocks in a thread: the executor's, or
    libuv's pool under uvloop; a lookup that hangs there is not stopped, only no longer waited for)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def discovered_specs(
    addresses: list[str], cfg: DiscoverySettings, settings: Settings, environ: Mapping[str, str]
) -> list[InstanceSpec]:
    """One spec per distinct address, in a stable order, named ``address:port``."""
    key = instance_key(environ, cfg.api_key_env, "[discovery]")
    out = []
    for addr in sorted(set(addresses), key=_sort_key):
        host = f"[{addr}]" if ":" in addr else addr
        out.append(
            InstanceSpec(
                name=f"{host}:{cfg.port}",
                url=f"{cfg.scheme}://{host}:{cfg.port}",
                api_key=key,
                role=cfg.role,
                cap=settings.dispatch.max_queue_per_instance,
                kv_events=cfg.kv_events,
                kv_events_replay=cfg.kv_events_replay,
            )
        )
    return out


def _sort_key(addr: str) -> tuple[int, int | str]:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return (2, addr)
    return (ip.version, int(ip))


class Discovery:
    """Re-resolves ``[discovery] dns`` and hands the addresses to ``apply`` (the gateway's fleet
    update, which returns the joined and left instance names); a failed lookup keeps the current
    set (logged once)."""

    def __init__(
        self,
        settings: Callable[[], Settings],
        resolver: Resolver,
        apply: Callable[[list[str]], tuple[list[str], list[str]]],
        known: Callable[[], int],
    ) -> None:
        self._settings = settings
        self._resolver = resolver
        self._apply = apply
        self._known = known
        self._ok = True

    async def resolve(self) -> bool:
        """One round; True when instances joined or left."""
        cfg = self._settings().discovery
        if cfg.dns is None:
            return False
        try:
            addresses = await asyncio.wait_for(self._resolver(cfg.dns, cfg.port), 10)
            if self._settings().discovery.dns != cfg.dns:
                return False  # a reload changed the name while we were resolving the old one
        except (OSError, TimeoutError) as exc:
            if self._ok:
                self._ok = False
                log.warning(
                    "cannot resolve %s (%s); keeping the %d instances found before",
                    cfg.dns,
                    exc,
                    self._known(),
                )
            return False
        if not self._ok:
            self._ok = True
            log.info("%s resolves again", cfg.dns)
        joined, left = self._apply(addresses)
        if joined or left:
            log.info("discovery %s: joined %s, left %s", cfg.dns, joined, left)
        return bool(joined or left)
