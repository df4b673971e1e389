"""The ``taogate`` command. It only maps flags onto settings and calls into the package."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import signal
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import tomli_w
import typer
import uvicorn
from rich.markup import escape

from taogate import __version__
from taogate.build import BUILD
from taogate.cli_settings import ClientOpt, ConfigOpt, default_config, load
from taogate.config_files import load_settings, redacted_dump
from taogate.dispatch.types import STRATEGIES
from taogate.observe.logs import (
    ACCESS_FLUSH_S,
    ACCESS_LOGGER,
    BatchedStreamHandler,
    flush_every,
    setup_logging,
)
from taogate.serving import Server, loop_factory, tune_runtime
from taogate.settings import ConfigError, Settings

app = typer.Typer(
    name="taogate",
    help="One OpenAI-compatible endpoint and one key in front of a fleet of vLLM servers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        # Eager: it runs while the options are parsed, before a missing command is an error.
        typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True),
    ] = False,
) -> None:
    """The root: --version is handled by its callback as it is parsed."""


@app.command()
def serve(
    config: ConfigOpt = None,
    client_settings: ClientOpt = None,
    host: Annotated[
        str | None, typer.Option(help=escape("Listen address (overrides [gateway] host)."))
    ] = None,
    port: Annotated[int | None, typer.Option(help=escape("Listen port (overrides [gateway] port)."))] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            help=escape(
                f"Dispatch strategy (overrides [dispatch] strategy): {', '.join(STRATEGIES)}. least_busy, "
                "the default, sends each request where its first token should come soonest; the others "
                "are baselines for A/B."
            )
        ),
    ] = None,
    max_queue_per_instance: Annotated[
        int | None,
        typer.Option(
            help=escape(
                "Hard cap on requests outstanding at one instance; past it, requests go elsewhere or wait "
                "in the gateway's queue (overrides [dispatch] max_queue_per_instance)."
            )
        ),
    ] = None,
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
    cfg_path = default_config(config)
    settings = load(cfg_path, client_settings, overrides)
    access = setup_logging(settings.gateway.log_level)
    try:
        settings.api_key()
    except ConfigError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(2) from None
    source = (lambda: load_settings(cfg_path, client_settings, overrides)) if cfg_path is not None else None
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        try:
            runner.run(_serve(settings, source, access))
        except ConfigError as exc:  # found while building the gateway (e.g. a [[keys]] env var unset)
            typer.echo(f"taogate: {exc}", err=True)
            raise typer.Exit(2) from None


async def _serve(settings: Settings, source: Any, access: BatchedStreamHandler | None = None) -> None:
    from taogate.app import create_app

    sink = partial(access.write_info, ACCESS_LOGGER) if access is not None else None
    application = create_app(settings, settings_source=source, access_sink=sink)
    tune_runtime()
    logging.getLogger("taogate").info("taogate %s, request path: %s", __version__, BUILD)
    g = settings.gateway
    server = Server(
        uvicorn.Config(
            application,
            host=g.host,
            port=g.port,
            log_level=g.log_level,
            timeout_graceful_shutdown=max(1, math.ceil(g.shutdown_timeout)),  # None would mean forever
            loop="auto",
            **application.server_options,  # the protocol and limits the tests serve it with too
        ),
        after_shutdown=access.flush_now if access is not None else None,
    )

    def reload() -> None:
        try:
            application.gateway.reload_from_source()
        except ConfigError as exc:
            logging.getLogger("taogate").error("reload refused, the running config stays: %s", exc)

    loop = asyncio.get_running_loop()
    if hasattr(signal, "SIGHUP"):  # without a config file, it says there is nothing to reload
        loop.add_signal_handler(signal.SIGHUP, reload)
    flusher = loop.create_task(flush_every(access, ACCESS_FLUSH_S)) if access is not None else None
    try:
        await server.serve()
    finally:
        if flusher is not None:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)


@app.command()
def pick(
    config: ConfigOpt = None,
    client_settings: ClientOpt = None,
    port: Annotated[int, typer.Option(help="gRPC port of the ext_proc service (0: a free one).")] = 9002,
    http_port: Annotated[int, typer.Option(help="/health, /metrics, admin API, fleet page.")] = 9003,
    host: Annotated[
        str | None, typer.Option(help=escape("Listen address (overrides [gateway] host)."))
    ] = None,
    key_check: Annotated[
        bool,
        typer.Option(
            help="Check the client's key (unified or named); --no-key-check where the gateway authenticates."
        ),
    ] = True,
) -> None:
    """Run as the endpoint picker of an inference gateway (Envoy ext_proc). SIGHUP reloads."""
    try:
        from taogate.picker.server import RunningPicker, run_picker
    except ImportError as exc:
        typer.echo(
            f"taogate: picker mode needs the picker extra (pip install 'taogate[picker]'): {exc}", err=True
        )
        raise typer.Exit(2) from None
    overrides: dict[str, Any] = {"gateway": {"host": host}} if host is not None else {}
    cfg_path = default_config(config)
    settings = load(cfg_path, client_settings, overrides)
    access = setup_logging(settings.gateway.log_level)
    try:
        settings.api_key()  # the admin API's key too, with or without the check on requests
    except ConfigError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(2) from None
    source = (lambda: load_settings(cfg_path, client_settings, overrides)) if cfg_path is not None else None
    sink = partial(access.write_info, ACCESS_LOGGER) if access is not None else None

    def ready(running: RunningPicker) -> None:
        tune_runtime()
        typer.echo(f"picker ready grpc {settings.gateway.host}:{running.grpc_port} http {running.http_url}")

    async def run() -> None:
        flusher = (
            asyncio.get_running_loop().create_task(flush_every(access, ACCESS_FLUSH_S)) if access else None
        )
        try:
            await run_picker(
                settings,
                port=port,
                http_port=http_port,
                check_key=key_check,
                source=source,
                access_sink=sink,
                on_ready=ready,
            )
        finally:
            if flusher is not None:
                flusher.cancel()
                await asyncio.gather(flusher, return_exceptions=True)
            if access is not None:
                access.flush_now()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(run())


@app.command("check-config")
def check_config(config: ConfigOpt = None, client_settings: ClientOpt = None) -> None:
    """Validate the config and print the effective values as TOML (secrets are never in it)."""
    from taogate.gateway import start_problems

    settings = load(config, client_settings, {})
    for warning in settings.warnings():
        typer.echo(f"# warning: {warning}", err=True)
    # What ``serve`` refuses to start with that lives outside the files (keys in the environment,
    # the packages precise mode needs): warnings here, where the secrets may not be set.
    for problem in start_problems(settings, os.environ):
        typer.echo(f"# warning: {problem}", err=True)
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
    from taogate.admin_commands import drain, reload, status, undrain
    from taogate.bench.cli import bench, demo, diagnose
    from taogate.emulator.cli import emulate

    for command in (status, drain, undrain, reload):
        app.command()(command)
    app.command("emulate")(emulate)
    app.command("bench")(bench)
    app.command("diagnose")(diagnose)
    app.command("demo")(demo)
    from taogate.tenancy.commands import keys_app

    app.add_typer(keys_app, name="keys")


_register_optional_commands()


def reflowed(doc: str) -> str:
    """A command's help with each paragraph's line breaks joined. typer joins them in the first
    paragraph only, so the source's line breaks made the rest ragged on a narrow terminal. A line
    that starts a list item or is indented keeps its break."""
    out: list[str] = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line.startswith((" ", "- ", "* ", "\b")) and not lines[-1].startswith("\b"):
                lines[-1] += " " + line
            else:
                lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _reflow_help(group: typer.Typer) -> None:
    for info in group.registered_commands:
        doc = info.help if info.help is not None else inspect.getdoc(info.callback)
        if doc:
            info.help = reflowed(doc)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _reflow_help(sub.typer_instance)


_reflow_help(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
