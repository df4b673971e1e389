"""The commands that ask a running gateway through its admin API: ``status``, ``drain``,
``undrain``, ``reload`` (``cli`` registers them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from taogate.admin_client import AdminError, admin_call
from taogate.cli_settings import ConfigOpt, load
from taogate.settings import ConfigError

__all__ = ["drain", "reload", "status", "undrain"]

UrlOpt = Annotated[
    str | None, typer.Option("--url", help=escape("Gateway URL (default: from [gateway] host and port)."))
]
NameArg = Annotated[
    str, typer.Argument(help="Instance name, as status shows it: its configured name, else host:port.")
]
KeyOpt = Annotated[
    str | None, typer.Option("--key", help="Admin key (default: the env var named by the config).")
]


def _admin(config: Path | None, url: str | None, key: str | None) -> tuple[str, str]:
    settings = load(config, None, {})
    if url is None:
        host = "127.0.0.1" if settings.gateway.host in ("0.0.0.0", "::") else settings.gateway.host
        host = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed in a URL
        url = f"http://{host}:{settings.gateway.port}"
    if key is None:
        try:
            key = settings.admin_key()
        except ConfigError as exc:
            typer.echo(f"taogate: {exc}", err=True)
            raise typer.Exit(2) from None
    return url.rstrip("/"), key


def _call(method: str, url: str, key: str) -> Any:
    try:
        return admin_call(method, url, key)
    except AdminError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None


def status(
    config: ConfigOpt = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Keep the view live, redrawn in place (Ctrl-C stops).")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --watch.", min=0.2)] = 1.0,
) -> None:
    """Every instance side by side: health, queues, engine state, last-minute TTFT, speed, verdict.
    Columns that do not fit the terminal are left out, least important first."""
    base, secret = _admin(config, url, key)
    if watch and as_json:
        typer.echo("taogate: --watch and --json do not go together", err=True)
        raise typer.Exit(2)
    from rich.console import Console

    from taogate.observe.console import status_view
    from taogate.observe.console import watch as watch_status

    def fetch() -> Any:
        try:
            return admin_call("GET", base + "/admin/instances", secret)
        except AdminError as exc:
            if exc.exit_code != 3:  # refused: the watch ends
                raise
            return str(exc)  # unreachable: said, and retried

    console = Console()
    if watch:
        try:
            watch_status(fetch, base, console, interval=interval)
        except AdminError as exc:
            typer.echo(f"taogate: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            return
    data = _call("GET", base + "/admin/instances", secret)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    console.print(status_view(data, base, console.width))


def drain(
    name: NameArg,
    config: ConfigOpt = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Stop sending new work to an instance; its in-flight requests finish (rolling restarts)."""
    _instance_action(name, "drain", config, url, key)


def undrain(
    name: NameArg,
    config: ConfigOpt = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Let a drained instance take work again."""
    _instance_action(name, "undrain", config, url, key)


def _instance_action(name: str, action: str, config: Path | None, url: str | None, key: str | None) -> None:
    base, secret = _admin(config, url, key)
    typer.echo(json.dumps(_call("POST", f"{base}/admin/instances/{name}/{action}", secret)))


def reload(config: ConfigOpt = None, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Ask a running gateway to re-read its config files (like SIGHUP)."""
    base, secret = _admin(config, url, key)
    typer.echo(json.dumps(_call("POST", f"{base}/admin/reload", secret)))
