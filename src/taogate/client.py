"""Build an OpenAI SDK client from ``settings.json``'s client profile.

    from taogate.client import openai_client
    client = openai_client("settings.json")          # or async_openai_client(...)

timeouts → the SDK's Timeout, ``retry.max_attempts`` → ``max_retries`` (attempts minus the first),
``headers`` → ``default_headers`` (so ``X-Request-Tag`` rides along), ``${ENV}`` in ``api_key`` expanded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import openai

from taogate.client_profile import ClientProfile
from taogate.config_files import read_client_settings


def api_base(base_url: str) -> str:
    """The SDK's base_url: the gateway's base plus /v1 (unless already given)."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _kwargs(profile: ClientProfile, environ: Mapping[str, str] | None) -> dict[str, object]:
    t = profile.timeout
    return {
        "base_url": api_base(profile.base_url),
        "api_key": profile.resolved_api_key(environ),
        "timeout": openai.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.connect),
        "max_retries": max(0, profile.retry.max_attempts - 1),
        "default_headers": dict(profile.headers),
    }


def load_profile(path: str | Path | ClientProfile) -> ClientProfile:
    if isinstance(path, ClientProfile):
        return path
    return read_client_settings(Path(path)).taotoken


def openai_client(
    path: str | Path | ClientProfile, environ: Mapping[str, str] | None = None
) -> openai.OpenAI:
    return openai.OpenAI(**_kwargs(load_profile(path), environ))  # type: ignore[arg-type]


def async_openai_client(
    path: str | Path | ClientProfile, environ: Mapping[str, str] | None = None
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(**_kwargs(load_profile(path), environ))  # type: ignore[arg-type]
