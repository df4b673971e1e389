"""Where ``bench`` and ``diagnose`` send their load, from the files ``serve`` reads and the flags.

The client profile (settings.json: ./settings.json unless named) gives the gateway's URL, key,
model, timeouts and headers; the instances are those ``serve`` would use (config.toml's
``[[instances]]``, else settings.json's ``vllm.instances``) unless ``--instance`` names them, and each
is called by the rule every command shares: its configured name, else host:port.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from taogate.client import api_base
from taogate.emulator.config import EmulatorConfig

if TYPE_CHECKING:
    from taogate.settings import DispatchSettings

__all__ = ["EMULATED_MODEL", "Endpoint", "fail", "resolve_endpoint"]

EMULATED_MODEL = EmulatorConfig().model


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the load goes, resolved from the files ``serve`` reads and the flags."""

    base_url: str | None
    key: str
    model: str
    headers: dict[str, str]
    timeout: httpx.Timeout
    instances: list[str]
    names: list[str]  # one per instance, by the rule every command shares (name, else host:port)
    key_error: str | None = None  # the profile's key could not be resolved (only a gateway needs it)
    dispatch: DispatchSettings | None = None  # the ``[dispatch]`` serve would run with, when a file was read

    @property
    def api_base(self) -> str | None:
        return None if self.base_url is None else api_base(self.base_url)


def fail(message: str, code: int = 3) -> typer.Exit:
    Console(stderr=True).print(f"[red]taogate:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _here(given: Path | None, name: str) -> Path | None:
    """``given``, else ./``name`` when it exists: the files ``serve`` reads by default."""
    if given is not None:
        return given
    here = Path(name)
    return here if here.exists() else None


def _fleet(
    config: Path | None, profile: Path | None, urls: list[str] | None
) -> tuple[list[tuple[str, str]], DispatchSettings | None]:
    """(url, name) per instance: ``--instance`` flags, else the instances ``serve`` would use
    (config.toml's ``[[instances]]``, else settings.json's ``vllm.instances``). A flag's URL that the
    config names keeps that name. With them, the ``[dispatch]`` section serve would run with (None
    when no file was read)."""
    from taogate.bench.report import instance_labels
    from taogate.config_files import load_settings
    from taogate.settings import ConfigError

    configured: list[tuple[str, str]] = []
    dispatch = None
    if config is not None or profile is not None:
        try:
            loaded = load_settings(config, profile)
        except ConfigError as exc:
            raise fail(str(exc)) from None
        configured, dispatch = [(i.url, i.label) for i in loaded.instances], loaded.dispatch
    if not urls:
        return configured, dispatch
    bases = [u.rstrip("/").removesuffix("/v1") for u in urls]
    named = dict(configured)
    # A URL given twice (one server as a fleet of two) keeps host:port#2 for its second use.
    return [
        (u, named.get(u, n) if "#" not in n else n)
        for u, n in zip(bases, instance_labels(bases), strict=True)
    ], dispatch


def resolve_endpoint(
    settings: Path | None,
    base_url: str | None,
    key: str | None,
    model: str | None,
    instances: list[str] | None,
    *,
    emulate: bool,
    config: Path | None = None,
) -> Endpoint:
    """Profile values, overridden by flags; emulated runs default the model to the emulator's.
    Like ``serve``, ./settings.json and ./config.toml are read when they exist and none is named."""
    from taogate.config_files import read_client_settings
    from taogate.settings import ConfigError

    settings = _here(settings, "settings.json")
    headers: dict[str, str] = {}
    timeout = httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=None)
    profile_base = profile_model = key_error = None
    profile_key = ""
    if settings is not None:
        try:
            client = read_client_settings(settings)
        except ConfigError as exc:
            raise fail(str(exc)) from None
        p = client.taotoken
        profile_base, profile_model, headers = p.base_url, p.default_model, dict(p.headers)
        timeout = httpx.Timeout(
            connect=p.timeout.connect, read=p.timeout.read, write=p.timeout.write, pool=None
        )
        if key is None:
            try:
                profile_key = p.resolved_api_key()
            except ConfigError as exc:
                key_error = f"{exc} (or pass --key)"
    fleet, dispatch = ([], None) if emulate else _fleet(_here(config, "config.toml"), settings, instances)
    return Endpoint(
        base_url=base_url or profile_base,
        key=key or profile_key or os.environ.get("TAOTOKEN_API_KEY", ""),
        model=model or (EMULATED_MODEL if emulate else profile_model) or EMULATED_MODEL,
        headers=headers,
        timeout=timeout,
        instances=[u for u, _ in fleet],
        names=[n for _, n in fleet],
        key_error=None if key or os.environ.get("TAOTOKEN_API_KEY") else key_error,
        dispatch=dispatch,
    )
