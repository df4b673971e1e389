"""Typed configuration: ``config.toml`` (gateway side) mirrored by one pydantic-settings tree, and
``settings.json``'s client profile. ``config_files`` reads the files into these.

Every key can be overridden by ``TAOGATE_<SECTION>__<KEY>`` (e.g.
``TAOGATE_DISPATCH__STRATEGY=round_robin``). Every validator names the offending key and the
accepted values, because most configuration trouble is spelling and URL mistakes (``strategy``, a
``base_url`` with ``?utm_…``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from taogate.dispatch.types import STRATEGIES, Role, Strategy

log = logging.getLogger("taogate.settings")


#: Read timeouts below this make long prefills time out and retry, which deepens queues.
MIN_SAFE_READ_TIMEOUT = 30.0


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_base_url(value: str, key: str) -> str:
    parts = urlsplit(value)
    if parts.query or parts.fragment:
        raise ValueError(
            f"{key} = {value!r} carries a query string or fragment; an API base never does. "
            "This is the website address (with ?utm_… tracking parameters), not the API: requests "
            f"would 404. Use {parts.scheme}://{parts.netloc}{parts.path} instead."
        )
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{key} = {value!r} must be an absolute http(s) URL, e.g. http://127.0.0.1:8080")
    return value.rstrip("/")


class GatewaySettings(_Section):
    """``[gateway]``: where clients reach us, the unified key, the upstream HTTP client."""

    base_url: str = Field(
        default="http://127.0.0.1:8080",
        description="Where clients reach the gateway; its path (e.g. /api) is also served as a prefix.",
    )
    api_key_env: str = Field(default="TAOTOKEN_API_KEY", description="Env var holding the unified key.")
    admin_key_env: str | None = Field(
        default=None, description="Env var of a separate admin key; unset means the unified key is admin."
    )
    host: str = Field(default="127.0.0.1", description="Listen address.")
    port: int = Field(default=8080, ge=0, le=65535, description="Listen port (0 picks a free one).")
    request_timeout: float = Field(
        default=120.0, gt=0, description="Seconds to wait for an instance's response (read timeout)."
    )
    connect_timeout: float = Field(default=10.0, gt=0, description="Seconds to connect to an instance.")
    write_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds to send a probe's request (the proxy path's is bounded by request_timeout).",
    )
    stream_idle_timeout: float = Field(
        default=60.0, gt=0, description="Seconds without a byte mid-stream before the stream is ended."
    )
    client_stall_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a streaming client may read nothing before the gateway gives up on it "
        "(the instance request is aborted and its slot freed).",
    )
    max_connections: int = Field(default=64, ge=1, description="Upstream connection pool size.")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="Largest request body (413).")
    shutdown_timeout: float = Field(default=30.0, ge=0, description="Seconds in-flight work gets on stop.")
    log_format: Literal["text", "json"] = Field(default="text", description="Per-request log line format.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="Logging level."
    )

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        return _check_base_url(v, "[gateway] base_url")

    @property
    def prefix(self) -> str:
        """The path part of base_url ('' or e.g. '/api'), served besides the plain routes."""
        return urlsplit(self.base_url).path.rstrip("/")


class RetrySettings(_Section):
    """``[dispatch.retry]``: failover before the first byte went downstream."""

    max_attempts: int = Field(default=3, ge=1, le=10, description="Attempts per request, first included.")
    backoff_base: float = Field(default=0.5, ge=0, description="First backoff in seconds (jittered).")
    backoff_max: float = Field(default=8.0, ge=0, description="Backoff cap in seconds.")
    budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="Retries allowed as a fraction of recent requests."
    )


class DispatchSettings(_Section):
    """``[dispatch]``: strategy, health, the per-instance cap and the bounded gateway queue."""

    strategy: Strategy = Field(default="least_busy", description="least_busy or round_robin.")
    health_check_interval: float = Field(default=10.0, gt=0, description="Seconds between health probes.")
    health_timeout: float = Field(default=2.0, gt=0, description="Seconds a probe may take.")
    unhealthy_after: int = Field(default=2, ge=1, description="Consecutive failed probes to mark down.")
    healthy_after: int = Field(default=1, ge=1, description="Consecutive good probes to mark up again.")
    max_queue_per_instance: int = Field(
        default=32, ge=1, description="Hard cap on requests outstanding at one instance."
    )
    queue_size: int = Field(default=256, ge=0, description="Gateway wait queue length (0: refuse at once).")
    queue_timeout: float = Field(default=30.0, gt=0, description="Seconds a request may wait in the queue.")
    scrape_interval: float = Field(
        default=1.0, ge=0, description="Seconds between /metrics scrapes of each instance (0: off)."
    )
    prefix_affinity: bool = Field(default=True, description="Send shared prefixes to the same instance.")
    affinity_slack: float = Field(
        default=0.0,
        ge=0,
        description="Extra seconds a cache hit may cost over the least loaded instance (0: none; the "
        "expected hit is already in the cost).",
    )
    warmup_tokens: int = Field(
        default=2048, ge=0, le=32768, description="Prefill probe per instance as it comes up (0: off)."
    )
    breaker_failures: int = Field(default=5, ge=1, description="Consecutive request failures to eject.")
    breaker_cooldown: float = Field(default=15.0, gt=0, description="Seconds an ejected instance rests.")
    retry: RetrySettings = Field(default_factory=RetrySettings)

    @property
    def policy_key(self) -> tuple[object, ...]:
        """What the dispatch policy is built from: a reload rebuilds it only when this changes."""
        return (self.strategy, self.prefix_affinity, self.affinity_slack)

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, v: object) -> object:
        if isinstance(v, str) and v not in STRATEGIES:
            raise ValueError(
                f"[dispatch] strategy = {v!r} is not a strategy; accepted values: "
                f"{', '.join(STRATEGIES)}. (A misspelling here would otherwise mean no least-busy dispatch.)"
            )
        return v


class PrefillSettings(_Section):
    """``[prefill]``: how long inputs are told apart and tagged."""

    tag: str = Field(default="prefill", description="Tag given to long-input traffic (header, log, metric).")
    long_input_threshold: int = Field(
        default=4096, ge=1, description="Estimated prompt tokens above which a request is long."
    )
    tokenizer: Path | None = Field(
        default=None, description="Optional local tokenizer.json for exact counts (needs `tokenizers`)."
    )
    chars_per_token: float = Field(
        default=4.0, gt=0, description="Initial guess before calibration from upstream usage."
    )
    chat_template: Path | None = Field(
        default=None,
        description="The model's chat template for precise prefix-cache dispatch (default: the one "
        "in tokenizer_config.json or chat_template.jinja beside the tokenizer).",
    )

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", v):
            raise ValueError(f"[prefill] tag = {v!r}: use 1-64 letters, digits, '_', '.', '-'")
        return v


class InstanceSettings(_Section):
    """One ``[[instances]]`` entry: a vLLM server (or any OpenAI-compatible base URL)."""

    url: str = Field(description="Base URL of the server, without /v1, e.g. http://127.0.0.1:8000.")
    name: str | None = Field(default=None, description="Label in logs and metrics; defaults to host:port.")
    api_key_env: str | None = Field(default=None, description="Env var with this instance's own key.")
    weight: float = Field(default=1.0, gt=0, description="Speed prior relative to the others (learned).")
    role: Role = Field(default="any", description="any, long (long inputs only) or short (short only).")
    max_queue: int | None = Field(default=None, ge=1, description="Overrides max_queue_per_instance.")
    kv_events: str | None = Field(
        default=None,
        description="ZMQ endpoint of its KV-cache events, as in its --kv-events-config (the gateway "
        "binds a non-wildcard address, which vLLM connects to); precise prefix-cache dispatch.",
    )
    kv_events_replay: str | None = Field(
        default=None, description="Its KV events' replay endpoint (replay_endpoint), to recover lost events."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = _check_base_url(v, "instance url")
        return v.removesuffix("/v1")

    @property
    def label(self) -> str:
        """The name, or host:port: never the URL's user:password part, since labels go into
        response headers, metrics and logs."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{parts.port}" if parts.port else host


class DiscoverySettings(_Section):
    """``[discovery]``: instances from a DNS name (e.g. a Kubernetes headless Service), re-resolved."""

    dns: str | None = Field(default=None, description="Name whose A/AAAA records are the instances.")
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM port on every discovered address.")
    scheme: Literal["http", "https"] = Field(default="http", description="Scheme of discovered instances.")
    interval: float = Field(default=10.0, gt=0, description="Seconds between re-resolutions.")
    role: Role = Field(default="any", description="Role of discovered instances.")
    api_key_env: str | None = Field(default=None, description="Env var with the instances' own key.")

    @field_validator("dns")
    @classmethod
    def _dns(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(c in v for c in "/ ?#@:")):
            raise ValueError(
                f"[discovery] dns = {v!r}: give a bare host name (port and scheme are separate keys), "
                "e.g. vllm-headless.default.svc.cluster.local"
            )
        return v


class ClientTimeout(_Section):
    connect: float = 10.0
    read: float = 120.0
    write: float = 30.0


class ClientRetry(_Section):
    max_attempts: int = Field(default=3, ge=1)
    backoff_base: float = Field(default=0.5, ge=0)
    backoff_max: float = Field(default=8.0, ge=0)


class ClientProfile(_Section):
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
        return _check_base_url(v, "settings.json taotoken.base_url")

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str:
        return expand_env(self.api_key, os.environ if environ is None else environ)


class VllmProfile(_Section):
    model_config = ConfigDict(extra="ignore")
    instances: list[str] = Field(default_factory=list)
    tensor_parallel_size: int | None = None


class ClientSettings(_Section):
    """The whole ``settings.json``."""

    model_config = ConfigDict(extra="ignore")
    taotoken: ClientProfile = Field(default_factory=ClientProfile)
    vllm: VllmProfile = Field(default_factory=VllmProfile)


class Settings(BaseSettings):
    """The gateway's whole configuration."""

    model_config = SettingsConfigDict(
        env_prefix="TAOGATE_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    instances: list[InstanceSettings] = Field(default_factory=list)
    overflow: InstanceSettings | None = Field(
        default=None, description="Used only when every primary instance is at its cap."
    )
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        labels = [i.label for i in self.instances]
        if self.overflow is not None:
            labels.append(self.overflow.label)
        dupes = sorted({n for n in labels if labels.count(n) > 1})
        if dupes:
            raise ValueError(
                f"[[instances]] and [overflow] names must be unique; repeated: {', '.join(dupes)} "
                "(give them distinct `name`s)"
            )
        return self

    def api_key(self, environ: Mapping[str, str] | None = None) -> str:
        """The unified key, from the env var named by ``api_key_env``; ConfigError names it if unset."""
        env = os.environ if environ is None else environ
        name = self.gateway.api_key_env
        value = env.get(name, "")
        if not value:
            raise ConfigError(
                f"[gateway] api_key_env names {name}, which is not set. Export the unified key first: "
                f"export {name}=<your key>"
            )
        return value

    def admin_key(self, environ: Mapping[str, str] | None = None) -> str:
        env = os.environ if environ is None else environ
        name = self.gateway.admin_key_env
        if name is None:
            return self.api_key(env)
        value = env.get(name, "")
        if not value:
            raise ConfigError(f"[gateway] admin_key_env names {name}, which is not set: export {name}=…")
        return value

    def restart_only_changes(self, new: Settings) -> list[str]:
        """Keys that differ in ``new`` but a running gateway cannot change (the listening socket, the
        routes, the connection pool, logging, the tokenizer): a reload names them in a warning."""
        a, b = self, new
        pairs = [
            ("[gateway] host", a.gateway.host, b.gateway.host),
            ("[gateway] port", a.gateway.port, b.gateway.port),
            ("[gateway] base_url path", a.gateway.prefix, b.gateway.prefix),
            ("[gateway] max_connections", a.gateway.max_connections, b.gateway.max_connections),
            ("[gateway] log_level", a.gateway.log_level, b.gateway.log_level),
            ("[prefill] tokenizer", a.prefill.tokenizer, b.prefill.tokenizer),
            ("[prefill] chars_per_token", a.prefill.chars_per_token, b.prefill.chars_per_token),
            ("[prefill] chat_template", a.prefill.chat_template, b.prefill.chat_template),
        ]
        return [key for key, old, cur in pairs if old != cur]

    def warnings(self) -> list[str]:
        """Problems that do not stop the gateway but will hurt long prefills."""
        out: list[str] = []
        if self.gateway.request_timeout < MIN_SAFE_READ_TIMEOUT:
            out.append(
                f"[gateway] request_timeout = {self.gateway.request_timeout:g}s is under "
                f"{MIN_SAFE_READ_TIMEOUT:g}s: long prefills will time out and retries will deepen "
                "the queues (use 120 s or more)."
            )
        if self.dispatch.retry.backoff_base < 0.1 and self.dispatch.retry.max_attempts > 1:
            out.append(
                "[dispatch.retry] backoff_base under 0.1 s: prefill retries are expensive and quick "
                "retries deepen queues."
            )
        caps = sum(i.max_queue or self.dispatch.max_queue_per_instance for i in self.instances)
        if caps > self.gateway.max_connections:
            out.append(
                f"[gateway] max_connections = {self.gateway.max_connections} is below the sum of the "
                f"instances' caps ({caps}): requests past it wait for a free upstream connection, and get "
                "503 after request_timeout."
            )
        if not self.instances and self.discovery.dns is None:
            out.append("no instances configured: every request will get 503 until some are added.")
        return out


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, environ: Mapping[str, str]) -> str:
    """Expand ``${NAME}`` references; an unset name is a ConfigError that names it."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in environ:
            raise ConfigError(f"{value!r} refers to ${{{name}}}, which is not set: export {name}=…")
        return environ[name]

    return _ENV_REF.sub(sub, value)
