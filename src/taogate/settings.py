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

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from taogate.dispatch.blocks import publisher_binds
from taogate.dispatch.types import STRATEGIES, Strategy
from taogate.gateway_settings import GatewaySettings
from taogate.instance_settings import DiscoverySettings, InstanceSettings, server_of
from taogate.key_settings import KeyList, LimitsSettings
from taogate.sections import Section

log = logging.getLogger("taogate.settings")


#: Read timeouts below this make long prefills time out and retry, which deepens queues.
MIN_SAFE_READ_TIMEOUT = 30.0


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key and the fix."""


class RetrySettings(Section):
    """``[dispatch.retry]``: failover before the first byte went downstream."""

    max_attempts: int = Field(default=3, ge=1, le=10, description="Attempts per request, first included.")
    backoff_base: float = Field(default=0.5, ge=0, description="First backoff in seconds (jittered).")
    backoff_max: float = Field(default=8.0, ge=0, description="Backoff cap in seconds.")
    budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="Retries allowed as a fraction of recent requests."
    )


class DispatchSettings(Section):
    """``[dispatch]``: strategy, health, the per-instance cap and the bounded gateway queue."""

    strategy: Strategy = Field(
        default="least_busy", description="least_busy, or round_robin / least_requests (baselines)."
    )
    health_check_interval: float = Field(default=10.0, gt=0, description="Seconds between health probes.")
    health_timeout: float = Field(default=2.0, gt=0, description="Seconds a probe may take.")
    unhealthy_after: int = Field(default=2, ge=1, description="Consecutive failed probes to mark down.")
    healthy_after: int = Field(default=1, ge=1, description="Consecutive good probes to mark up again.")
    max_queue_per_instance: int = Field(
        default=32, ge=1, description="Hard cap on requests outstanding at one instance."
    )
    queue_size: int = Field(default=256, ge=0, description="Gateway wait queue length (0: refuse at once).")
    queue_timeout: float = Field(default=30.0, gt=0, description="Seconds a request may wait in the queue.")
    oldest_every: int = Field(default=4, ge=1, description="The queue's oldest waiter goes every N grants.")
    scrape_interval: float = Field(
        default=1.0, ge=0, description="Seconds between /metrics scrapes of each instance (0: off)."
    )
    prefix_affinity: bool = Field(default=True, description="Send shared prefixes to the same instance.")
    affinity_slack: float = Field(
        default=0.0,
        ge=0,
        description="Extra seconds a cache hit may cost over the least loaded instance, beyond the "
        "quarter more than its cost that an instance holding the prefix may always cost (0: none).",
    )
    route_receipt: bool = Field(
        default=False,
        description="Every response carries x-taogate-route: the chosen instance's estimate and the "
        "runner-up's, term by term (a request may ask with X-Taogate-Route: 1).",
    )
    warmup_tokens: int = Field(
        default=2048, ge=0, le=32768, description="Prefill probe per instance as it comes up (0: off)."
    )
    warmup_wait: float = Field(
        default=60.0,
        ge=0,
        description="Seconds a starting gateway waits for the instances' warm-ups before it listens; "
        "one still running then (its engine busy) teaches dispatch when it ends.",
    )
    remeasure_after: float = Field(
        default=60.0,
        ge=0,
        description="Seconds an instance that reads slow (flagged, or unflagged on a doubtful "
        "estimate) may teach dispatch nothing, idle, before the warm-up's prompts measure it again "
        "(0: never).",
    )
    breaker_failures: int = Field(default=5, ge=1, description="Consecutive request failures to eject.")
    breaker_cooldown: float = Field(default=15.0, gt=0, description="Seconds an ejected instance rests.")
    breaker_max_cooldown: float = Field(
        default=300.0, gt=0, description="Longest rest: each failed trial doubles it up to this."
    )
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


class PrefillSettings(Section):
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


#: An InferenceObjective's name is a Kubernetes object name (a DNS subdomain).
_OBJECTIVE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class PickerSettings(Section):
    """``[picker]``: what ``taogate pick`` reads from the inference gateway in front of it."""

    objectives: dict[str, int] = Field(
        default_factory=dict,
        description="InferenceObjective name = its priority (higher first), for the objective header.",
    )

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, v: dict[str, int]) -> dict[str, int]:
        for name, priority in v.items():
            if not _OBJECTIVE_NAME.fullmatch(name):
                raise ValueError(
                    f"[picker] objectives: {name!r} is not an InferenceObjective name "
                    "(lowercase letters, digits, '-' and '.', at most 253)"
                )
            if not -(2**31) <= priority < 2**31:
                raise ValueError(f"[picker] objectives: {name} = {priority} is outside a 32-bit priority")
        return v


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
    keys: KeyList = Field(default_factory=list, description="Named client keys, beside the unified one.")
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    picker: PickerSettings = Field(default_factory=PickerSettings)

    @property
    def listed(self) -> list[InstanceSettings]:
        """The instances the config lists, the overflow one last."""
        return [*self.instances, *([self.overflow] if self.overflow is not None else [])]

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        listed = self.listed
        labels = [i.label for i in listed]
        bound: dict[str, str] = {}
        for item in listed:  # an endpoint the gateway binds (vLLM connects) serves one instance
            ep = item.kv_events
            if ep is not None and not publisher_binds(ep) and bound.setdefault(ep, item.label) != item.label:
                raise ValueError(
                    f"{bound[ep]} and {item.label} both give kv_events = {ep!r}, which the gateway "
                    "binds: one socket would take both engines' events as one's. Give each its own port."
                )
        dupes = sorted({n for n in labels if labels.count(n) > 1})
        if dupes:
            raise ValueError(
                f"[[instances]] and [overflow] names must be unique; repeated: {', '.join(dupes)} "
                "(one server listed twice: remove the repeat; two servers: give them distinct `name`s)"
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

    def instance_caps(self) -> int:
        """Requests the configured instances (the overflow one included) may hold at once."""
        return sum(i.max_queue or self.dispatch.max_queue_per_instance for i in self.listed)

    def upstream_connections(self) -> int:
        """Connections the hop may keep open: ``max_connections``, else the instances' caps (at
        least 64, for instances found later by discovery). The listener leaves file descriptors
        for them."""
        return self.gateway.max_connections or max(64, self.instance_caps())

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
            # Read at start by uvicorn's graceful stop and the listener's write bound; the drain and
            # the stream relay take the new value at once.
            ("[gateway] shutdown_timeout", a.gateway.shutdown_timeout, b.gateway.shutdown_timeout),
            (
                "[gateway] client_stall_timeout",
                a.gateway.client_stall_timeout,
                b.gateway.client_stall_timeout,
            ),
            *(
                (f"[gateway] {key}", getattr(a.gateway, key), getattr(b.gateway, key))
                for key in GatewaySettings.LISTENER_KEYS
            ),
            ("[prefill] tokenizer", a.prefill.tokenizer, b.prefill.tokenizer),
            ("[prefill] chars_per_token", a.prefill.chars_per_token, b.prefill.chars_per_token),
            ("[prefill] chat_template", a.prefill.chat_template, b.prefill.chat_template),
            ("[limits] store", a.limits.store, b.limits.store),
            ("[limits] store_timeout", a.limits.store_timeout, b.limits.store_timeout),  # the socket's
        ]
        return [key for key, old, cur in pairs if old != cur]

    def warnings(self) -> list[str]:
        """Problems that do not stop the gateway but will hurt long prefills."""
        out: list[str] = []
        seen: dict[tuple[str, str, int | None, str], str] = {}
        for item in self.listed:  # two caps on one queue, or overflow past a listed instance's cap
            server = server_of(item.url)
            first = seen.get(server)
            if first is None:
                seen[server] = item.label
            else:
                out.append(
                    f"[[instances]] and [overflow] list one server twice, as {first} and {item.label} "
                    f"({item.url}): each entry is capped on its own, so that server may hold both "
                    "caps at once. Remove the repeat unless that is meant (a test of one server)."
                )
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
        caps = self.instance_caps()
        if self.gateway.max_connections is not None and caps > self.gateway.max_connections:
            out.append(
                f"[gateway] max_connections = {self.gateway.max_connections} is below the sum of the "
                f"instances' caps ({caps}): requests past it wait for a free upstream connection, and get "
                "503 after request_timeout."
            )
        if not self.instances and self.discovery.dns is None:
            out.append("no instances configured: every request will get 503 until some are added.")
        if self.discovery.kv_events and self.discovery.dns is None:
            out.append("[discovery] kv_events is set without dns: no instance is discovered to use it.")
        return out

    @property
    def kv_events(self) -> bool:
        """Whether some instance, listed, discovered or the overflow one, publishes its KV events
        (precise mode)."""
        overflow = self.overflow is not None and bool(self.overflow.kv_events)
        return overflow or bool(self.discovery.kv_events) or any(i.kv_events for i in self.instances)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, environ: Mapping[str, str]) -> str:
    """Expand ``${NAME}`` references; an unset name is a ConfigError that names it."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if not environ.get(name):  # set but empty is as good as unset: an empty key is refused
            raise ConfigError(f"{value!r} refers to ${{{name}}}, which is not set: export {name}=…")
        return environ[name]

    return _ENV_REF.sub(sub, value)
