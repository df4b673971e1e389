"""Where the fleet comes from: ``[[instances]]`` entries, ``[discovery]``, and the one name each
instance goes by in every command, the page and the metrics."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator

from taogate.dispatch.types import Role, SchedulingPolicy
from taogate.sections import Section, check_base_url

__all__ = ["DiscoverySettings", "InstanceSettings", "instance_label", "server_of"]


def instance_label(url: str, name: str | None = None) -> str:
    """What every command, the page and the metrics call an instance: its configured name, else its
    URL's host:port (never the user:password part, since labels go into headers, metrics and logs)."""
    if name:
        return name
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port}" if parts.port else host


_DEFAULT_PORTS = {"http": 80, "https": 443}


def server_of(url: str) -> tuple[str, str, int | None, str]:
    """The server a base URL names, however it is spelled (case, a default port, credentials)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return (
        scheme,
        (parts.hostname or "").lower(),
        parts.port or _DEFAULT_PORTS.get(scheme),
        parts.path.rstrip("/"),
    )


class InstanceSettings(Section):
    """One ``[[instances]]`` entry: a vLLM server (or any OpenAI-compatible base URL)."""

    url: str = Field(description="Base URL of the server, without /v1, e.g. http://127.0.0.1:8000.")
    name: str | None = Field(default=None, description="Label in logs and metrics; defaults to host:port.")
    api_key_env: str | None = Field(default=None, description="Env var with this instance's own key.")
    weight: float = Field(default=1.0, gt=0, description="Speed prior relative to the others (learned).")
    role: Role = Field(default="any", description="any, long (long inputs only) or short (short only).")
    max_queue: int | None = Field(default=None, ge=1, description="Overrides max_queue_per_instance.")
    scheduling_policy: SchedulingPolicy = Field(default="fcfs", description="Its --scheduling-policy.")
    kv_events: str | None = Field(
        default=None,
        description="ZMQ endpoint of its KV-cache events, as in its --kv-events-config; precise "
        "prefix-cache dispatch. vLLM binds a wildcard (tcp://*:5557, the default), [::] or ipc "
        "endpoint, and the gateway connects (to a wildcard's port on this instance's url host); "
        "vLLM connects to any other, which the gateway binds (not 0.0.0.0: give an address). "
        "Data parallel: rank 0 only.",
    )
    kv_events_replay: str | None = Field(
        default=None,
        description="Its KV events' replay endpoint (replay_endpoint), to recover lost events; vLLM "
        "binds it, the gateway connects (to a wildcard's port on this instance's url host).",
    )

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        if not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{v!r}: a ZMQ endpoint, e.g. tcp://*:5557 or tcp://10.0.0.2:5557")
        # ([::] has "::": vLLM binds it, as the replay endpoint always, and the gateway connects.)
        if info.field_name == "kv_events" and v.startswith("tcp://0.0.0.0:"):
            raise ValueError(
                f"{v!r}: vLLM would connect to it and the gateway bind it on every interface, where "
                "anyone could inject cache events; give this gateway's address (vLLM connects "
                "there), or tcp://*:PORT (vLLM binds, the gateway connects to the instance's host)"
            )
        return v

    @model_validator(mode="after")
    def _two_endpoints(self) -> InstanceSettings:
        if self.kv_events is not None and self.kv_events == self.kv_events_replay:
            raise ValueError(
                f"kv_events and kv_events_replay are both {self.kv_events!r}: the events and their "
                "replay are two sockets (vLLM's defaults: tcp://*:5557 and tcp://*:5558)"
            )
        return self

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = check_base_url(v, "instance url")
        return v.removesuffix("/v1")

    @property
    def label(self) -> str:
        return instance_label(self.url, self.name)


#: The wildcard hosts a pod's publisher binds (``dispatch.blocks.publisher_binds``'s tcp ones).
_WILDCARD_HOSTS = frozenset({"*", "[::]"})


class DiscoverySettings(Section):
    """``[discovery]``: instances from a DNS name (e.g. a Kubernetes headless Service), re-resolved."""

    dns: str | None = Field(default=None, description="Name whose A/AAAA records are the instances.")
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM port on every discovered address.")
    scheme: Literal["http", "https"] = Field(default="http", description="Scheme of discovered instances.")
    interval: float = Field(default=10.0, gt=0, description="Seconds between re-resolutions.")
    role: Role = Field(default="any", description="Role of discovered instances.")
    api_key_env: str | None = Field(default=None, description="Env var with the instances' own key.")
    kv_events: str | None = Field(
        default=None,
        description="Every pod's KV-events endpoint as its --kv-events-config gives it, a wildcard "
        "(tcp://*:5557): each pod binds it, and the gateway connects to that port on the pod's "
        "address; precise prefix-cache dispatch.",
    )
    kv_events_replay: str | None = Field(
        default=None, description="Every pod's replay endpoint (tcp://*:5558), reached the same way."
    )

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _wildcard(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        host, sep, port = v.removeprefix("tcp://").rpartition(":")
        if not v.startswith("tcp://") or not sep or host not in _WILDCARD_HOSTS or not port.isdigit():
            raise ValueError(
                f"[discovery] {info.field_name} = {v!r}: a wildcard endpoint, e.g. tcp://*:5557 (each "
                "pod binds it and the gateway connects to that port on every discovered address)"
            )
        return v

    @field_validator("dns")
    @classmethod
    def _dns(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(c in v for c in "/ ?#@:")):
            raise ValueError(
                f"[discovery] dns = {v!r}: give a bare host name (port and scheme are separate keys), "
                "e.g. vllm-headless.default.svc.cluster.local"
            )
        return v
