"""``settings.json``, the client side's file: how a client reaches the gateway (its ``taotoken``
profile, which ``taogate.client`` and ``taogate bench`` read) and which vLLM instances stand behind
it (the gateway's instances when its TOML lists none). Unknown keys are ignored: the file may carry
other tools' settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import ConfigDict, Field, field_validator

from taogate.sections import Section, check_base_url
from taogate.settings import expand_env

__all__ = ["ClientProfile", "ClientRetry", "ClientSettings", "ClientTimeout", "VllmProfile"]


class ClientTimeout(Section):
    connect: float = Field(default=10.0, gt=0)
    read: float = Field(default=120.0, gt=0)
    write: float = Field(default=30.0, gt=0)


class ClientRetry(Section):
    """Attempts per request; the backoff between them is the OpenAI SDK's own (0.5 s doubling to
    8 s, these defaults), which its clients do not let a caller set: the two backoff keys are read
    for the article's file and checked, not applied."""

    max_attempts: int = Field(default=3, ge=1)
    backoff_base: float = Field(default=0.5, ge=0)
    backoff_max: float = Field(default=8.0, ge=0)


class ClientProfile(Section):
    """``settings.json``'s ``taotoken`` object: how a client reaches the gateway."""

    model_config = ConfigDict(extra="ignore")
    base_url: str = "http://127.0.0.1:8080"
    api_key: str = "${TAOTOKEN_API_KEY}"
    default_model: str = "your-model-name"
    timeout: ClientTimeout = Field(default_factory=ClientTimeout)
    retry: ClientRetry = Field(default_factory=ClientRetry)
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        return check_base_url(v, "settings.json taotoken.base_url")

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str:
        return expand_env(self.api_key, os.environ if environ is None else environ)


class VllmProfile(Section):
    model_config = ConfigDict(extra="ignore")
    instances: list[str] = Field(default_factory=list)
    tensor_parallel_size: int | None = None


class ClientSettings(Section):
    """The whole ``settings.json``."""

    model_config = ConfigDict(extra="ignore")
    taotoken: ClientProfile = Field(default_factory=ClientProfile)
    vllm: VllmProfile = Field(default_factory=VllmProfile)
