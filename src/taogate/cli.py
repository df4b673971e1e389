"""The ``taogate`` command. It only maps flags onto settings and calls into the package."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import tomli_w
import typer
import uvicorn

from taogate import __version__
from taogate.settings import ConfigError, Settings, load_settings, redacted_dump

app = typer.Typer(
    name="taogate",
    help="One OpenAI-compatible endpoint and one key in front of a fleet of vLLM servers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="config.toml (default: ./config.toml when it exists)."),
]
ClientOpt = Annotated[
    Path | None,
    typer.Option("--settings", help="settings.json for the instance list (default: next to config.toml)."),
]


def _default_config(config: Path | None) -> Path | None:
    if config is not None:
        return config
    here = Path("config.toml")
    return here if here.exists() else None


def _load(config: Path | None, client: Path | None, overrides: dict[str, Any]) -> Settings:
    try:
        return load_settings(_default_config(config), client, overrides)
    except ConfigError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(2) from None


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit


@app.command()
def serve(
    config: ConfigOpt = None,
    client_settings: ClientOpt = None,
    host: Annotated[str | None, typer.Option(help="Listen address (overrides [gateway] host).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (overrides [gateway] port).")] = None,
    strategy: Annotated[str | None, typer.Option(help="least_busy or round_robin.")] = None,
    max_queue_per_instance: Annotated[int | None, typer.Option(help="Per-instance cap.")] = None,
) -> None:
    """Run the gateway. SIGHUP reloads the config; SIGTERM drains and stops."""
    overrides: dict[str, Any] = {}
    gw: dict[str, Any] = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    dp: dict[str, Any] = {
        k: v
        for k, v in {"strategy": strategy, "max_queue_per_instance": max_queue_per_instance}.items()
        if v is not None
    }
    if gw:
        overrides["gateway"] = gw
    if dp:
        overrides["dispatch"] = dp
    cfg_path = _default_config(config)
    settings = _load(cfg_path, client_settings, overrides)
    setup_logging(settings.gateway.log_level)
    try:
        settings.api_key()
    except ConfigError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(2) from None
    source = (lambda: load_settings(cfg_path, client_settings, overrides)) if cfg_path is not None else None
    asyncio.run(_serve(settings, source))


async def _serve(settings: Settings, source: Any) -> None:
    from taogate.app import create_app

    application = create_app(settings, settings_source=source)
    g = settings.gateway
    server = uvicorn.Server(
        uvicorn.Config(
            application,
            host=g.host,
            port=g.port,
            log_level=g.log_level,
            access_log=False,  # taogate writes its own structured line per request
            server_header=False,
            timeout_graceful_shutdown=int(g.shutdown_timeout) or None,
            loop="auto",
            http="auto",
        )
    )

    def reload() -> None:
        try:
            application.gateway.reload_from_source()
        except ConfigError as exc:
            logging.getLogger("taogate").error("reload refused, the running config stays: %s", exc)

    loop = asyncio.get_running_loop()
    if source is not None and hasattr(signal, "SIGHUP"):
        loop.add_signal_handler(signal.SIGHUP, reload)
    await server.serve()


@app.command("check-config")
def check_config(config: ConfigOpt = None, client_settings: ClientOpt = None) -> None:
    """Validate the config and print the effective values as TOML (secrets are never in it)."""
    settings = _load(config, client_settings, {})
    for warning in settings.warnings():
        typer.echo(f"# warning: {warning}", err=True)
    try:
        settings.api_key()
    except ConfigError as exc:
        typer.echo(f"# warning: {exc}", err=True)
    typer.echo(tomli_w.dumps(redacted_dump(settings)), nl=False)


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="Where to write config.toml and settings.json.")] = Path(),
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
) -> None:
    """Write a commented default config.toml and settings.json."""
    templates = resources.files("taogate") / "templates"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.toml", "settings.json"):
        target = directory / name
        if target.exists() and not force:
            typer.echo(f"taogate: {target} exists; use --force to overwrite", err=True)
            raise typer.Exit(1)
        target.write_text((templates / name).read_text(encoding="utf-8"), encoding="utf-8")
        typer.echo(f"wrote {target}")


def _register_optional_commands() -> None:
    from taogate.emulator.cli import emulate

    app.command("emulate")(emulate)


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
