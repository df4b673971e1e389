"""``taogate keys add|list|revoke``: named client keys in config.toml. A running gateway takes the
change on ``taogate reload`` (or SIGHUP)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import typer

from taogate.config_files import load_settings
from taogate.settings import ConfigError
from taogate.tenancy.keyfile import add_key, remove_key
from taogate.tenancy.keys import new_key

__all__ = ["keys_app"]

keys_app = typer.Typer(
    help="Named client keys in config.toml: add, list, revoke (then `taogate reload`).",
    no_args_is_help=True,
)

ConfigPath = Annotated[Path, typer.Option("--config", "-c", help="The config file to edit.")]
Name = Annotated[str, typer.Argument(help="The key's name (metrics, logs, /admin/keys).")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"taogate: {message}", err=True)
    return typer.Exit(2)


def _write(path: Path, text: str) -> None:
    """Replace the file in one step, so a gateway reloading meanwhile reads the old or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _checked(path: Path, text: str) -> None:
    """The edited file must still load as a whole before it replaces the old one."""
    tmp = path.with_name(path.name + ".check.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        load_settings(tmp)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    finally:
        tmp.unlink(missing_ok=True)


@keys_app.command("add")
def add(  # noqa: PLR0917 - typer commands take one parameter per flag
    name: Name,
    config: ConfigPath = Path("config.toml"),
    requests_per_minute: Annotated[int | None, typer.Option(help="Requests per window.")] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(help="Tokens per window (from usage).")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="Requests in flight at once.")] = None,
    model: Annotated[list[str] | None, typer.Option(help="A model it may use (repeat; default all).")] = None,
    max_priority: Annotated[int | None, typer.Option(help="Most urgent priority class it may claim.")] = None,
    weight: Annotated[float | None, typer.Option(help="Its share under contention (default 1).")] = None,
) -> None:
    """Make a new key: printed once, only its SHA-256 written to the config."""
    text = config.read_text(encoding="utf-8") if config.exists() else ""
    key = new_key()
    limits = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrency": max_concurrency,
        "models": model or None,
        "max_priority": max_priority,
        "weight": weight,
    }
    try:
        out = add_key(text, name, hashlib.sha256(key.encode()).hexdigest(), limits)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    _checked(config, out)
    _write(config, out)
    typer.echo(key)
    typer.echo(
        f"taogate: key {name!r} added to {config} (only its hash). This is the only time it is shown; "
        "run `taogate reload` for a running gateway to take it.",
        err=True,
    )


@keys_app.command("list")
def list_keys(config: ConfigPath = Path("config.toml")) -> None:
    """The named keys of the config and their limits (never a key)."""
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    for k in settings.keys:
        secret = f"env {k.key_env}" if k.key_env else f"sha256 {(k.key_sha256 or '')[:12]}…"
        limits = [
            f"{label}={value}"
            for label, value in (
                ("rpm", k.requests_per_minute),
                ("tpm", k.tokens_per_minute),
                ("concurrency", k.max_concurrency),
                ("models", ",".join(k.models) if k.models is not None else None),
                ("max_priority", k.max_priority or None),
                ("weight", k.weight if k.weight != 1.0 else None),
            )
            if value is not None
        ]
        typer.echo(f"{k.name}\t{secret}\t{' '.join(limits) or 'no limits'}")


@keys_app.command("revoke")
def revoke(name: Name, config: ConfigPath = Path("config.toml")) -> None:
    """Remove a named key from the config; `taogate reload` then refuses it."""
    try:
        out = remove_key(config.read_text(encoding="utf-8"), name)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except KeyError:
        raise _fail(f"no [[keys]] entry named {name!r} in {config}") from None
    _checked(config, out)
    _write(config, out)
    typer.echo(f"taogate: key {name!r} revoked in {config}; run `taogate reload` to refuse it now.", err=True)
