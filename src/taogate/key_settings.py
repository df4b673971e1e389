"""``[[keys]]`` and ``[limits]``: the named client keys and where their limits are counted.

Part of the one settings tree (``taogate.settings`` holds them as ``Settings.keys`` and
``Settings.limits``), read by the tenancy package, as ``instance_settings`` is by the fleet.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from taogate.sections import Section

__all__ = ["UNIFIED_KEY", "KeyList", "KeySettings", "LimitsSettings"]


#: The unified key's name in the key table, metrics and logs: no named key may take it.
UNIFIED_KEY = "unified"


class KeySettings(Section):
    """One ``[[keys]]`` entry: a named client key beside the unified one, with its own limits."""

    name: str = Field(description="The key's name in metrics, logs and /admin/keys.")
    key_env: str | None = Field(default=None, description="Env var holding the key.")
    key_sha256: str | None = Field(
        default=None,
        description="The key's SHA-256, hex (`taogate keys add` writes it): no secret in a file.",
    )
    requests_per_minute: int | None = Field(default=None, ge=1, description="Requests per [limits] window.")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="Prompt + completion tokens per [limits] window (from usage)."
    )
    max_concurrency: int | None = Field(default=None, ge=1, description="Requests in flight at once.")
    models: list[str] | None = Field(default=None, description="The models it may use (default: all).")
    max_priority: int = Field(
        default=0, description="The most urgent priority class it may claim (lower is more urgent)."
    )
    weight: float = Field(default=1.0, gt=0, description="Its share of the fleet under contention.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", v) or v == UNIFIED_KEY:
            raise ValueError(
                f"[[keys]] name = {v!r}: use 1-64 letters, digits, '_', '.', '-' ({UNIFIED_KEY!r} is the "
                "unified key's)"
            )
        return v

    @field_validator("key_sha256")
    @classmethod
    def _sha256(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError(f"[[keys]] key_sha256 = {v[:80]!r}: 64 hex digits, as `taogate keys add` writes")
        return None if v is None else v.lower()

    @model_validator(mode="after")
    def _one_secret(self) -> KeySettings:
        if (self.key_env is None) == (self.key_sha256 is None):
            raise ValueError(f"[[keys]] {self.name}: give exactly one of key_env or key_sha256")
        return self


def _unique(keys: list[KeySettings]) -> list[KeySettings]:
    names = [k.name for k in keys]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"[[keys]] names must be unique; repeated: {', '.join(repeated)}")
    return keys


KeyList = Annotated[list[KeySettings], AfterValidator(_unique)]


class LimitsSettings(Section):
    """``[limits]``: where named keys' rate limits are counted, and the unified key's priority ceiling."""

    store: str | None = Field(
        default=None,
        description="redis://host:6379/0 to share limits across replicas (default: in-process).",
    )
    on_store_error: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open", description="When the store is down or slow: admit (fail_open) or 503."
    )
    store_timeout: float = Field(default=0.1, gt=0, le=5, description="Seconds one store call may take.")
    window: float = Field(
        default=60.0, gt=0, description="Seconds of the *_per_minute windows (a minute; shorter in tests)."
    )
    max_priority: int = Field(
        default=0, description="The most urgent priority class the unified key may claim (lower is more)."
    )

    @field_validator("store")
    @classmethod
    def _store(cls, v: str | None) -> str | None:
        if v is not None and urlsplit(v).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"[limits] store = {v!r}: a redis://, rediss:// or unix:// URL")
        return v
