"""What the commands share about the config: its options, where it is looked for, its loading."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from taogate.config_files import load_settings
from taogate.settings import ConfigError, Settings

__all__ = ["ClientOpt", "ConfigOpt", "default_config", "load"]

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="config.toml (default: ./config.toml when it exists)."),
]
ClientOpt = Annotated[
    Path | None,
    typer.Option("--settings", help="settings.json for the instance list (default: next to config.toml)."),
]


def default_config(config: Path | None) -> Path | None:
    """``config``, else ./config.toml when it exists."""
    if config is not None:
        return config
    here = Path("config.toml")
    return here if here.exists() else None


def load(config: Path | None, client: Path | None, overrides: dict[str, Any]) -> Settings:
    """The settings, or the config's error said and exit code 2."""
    try:
        return load_settings(default_config(config), client, overrides)
    except ConfigError as exc:
        typer.echo(f"taogate: {exc}", err=True)
        raise typer.Exit(2) from None
