"""Reading the configuration files into ``Settings``: ``config.toml``, then ``settings.json``.

Sources, strongest first: explicit overrides (CLI flags) > environment (``TAOGATE_<SECTION>__<KEY>``)
> the TOML file > defaults. When ``config.toml`` declares no ``[[instances]]``, the instance list
comes from ``settings.json``'s ``vllm.instances`` (the client profile), looked up next to the TOML
file or given explicitly. A file that cannot be used is a ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from taogate.client_profile import ClientSettings
from taogate.settings import ConfigError, Settings

__all__ = ["load_settings", "read_client_settings", "read_toml", "redacted_dump"]


class _DictSource(PydanticBaseSettingsSource):
    """Values already read from files, weakest of the sources."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (misspelled? see `taogate init` for every key)"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def read_client_settings(path: Path) -> ClientSettings:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        return ClientSettings.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, str(path))) from exc


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def load_settings(
    config: Path | None = None,
    client_settings: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the effective Settings from files, environment and explicit overrides.

    ``overrides`` is nested like the TOML (``{"gateway": {"port": 9000}}``) and beats everything.
    """
    data: dict[str, Any] = read_toml(config) if config is not None else {}
    origin = str(config) if config is not None else "defaults"
    if not data.get("instances"):
        json_path = client_settings
        if json_path is None and config is not None:
            candidate = config.with_name("settings.json")
            json_path = candidate if candidate.exists() else None
        if json_path is not None:
            client = read_client_settings(json_path)
            if client.vllm.instances:
                data["instances"] = [{"url": u} for u in client.vllm.instances]
                origin += f" + {json_path}"

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _DictSource(settings_cls, data))

    if env := sorted(k for k in os.environ if k.upper().startswith("TAOGATE_")):
        origin += f" + environment {', '.join(env)}"  # beats the files: a wrong value may be there
    try:
        loaded = _Loaded(**dict(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from exc
    # Hand back the plain type: callers compare, copy and dump Settings, not a per-call subclass.
    return Settings.model_construct(**{k: getattr(loaded, k) for k in Settings.model_fields})


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.netloc.rpartition("@")[2]  # as written: an IPv6 address keeps its brackets, the port too
    netloc = f"***@{host}"
    return parts._replace(netloc=netloc).geturl()


def redacted_dump(settings: Settings) -> dict[str, Any]:
    """The effective config as TOML-ready data.

    Keys live in env vars and only their *names* are in the config; credentials written into a URL
    (user:password@host) are masked.
    """
    data = settings.model_dump(mode="json", exclude_none=True)
    data["gateway"]["base_url"] = _redact_url(data["gateway"]["base_url"])
    for item in [*data.get("instances", []), data.get("overflow") or {}]:
        if "url" in item:
            item["url"] = _redact_url(item["url"])
    return data
