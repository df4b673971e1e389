"""``[gateway]``: where clients reach the gateway, its keys, the upstream HTTP client, and what a
client connection may cost."""

from __future__ import annotations

from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from taogate.sections import Section, check_base_url

__all__ = ["GatewaySettings"]


class GatewaySettings(Section):
    """``[gateway]``: where clients reach us, the unified key, the upstream HTTP client."""

    base_url: str = Field(
        default="http://127.0.0.1:8080",
        description="Where clients reach the gateway (a trailing /v1 dropped); its path (e.g. /api) is "
        "also served as a prefix.",
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
        default=60.0,
        gt=0,
        description="Seconds without a complete event mid-stream before the stream is ended.",
    )
    client_stall_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a streaming client may read nothing before the gateway gives up on it "
        "(the instance request is aborted and its slot freed); any other write to a client waits "
        "twice this before the connection is dropped (the listener's, read at start).",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Upstream connections open at once, all instances together. Unset: no limit of "
        "the pool's own; each instance's cap already bounds the connections in use there.",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="Largest request body (413).")
    max_json_items: int = Field(
        default=1_000_000,
        ge=1000,
        description="Most JSON values in a request body, counted by its commas (400 too_many_items).",
    )
    # What one client or one instance may cost (defaults: nginx's and Envoy's, the larger of the two).
    max_header_bytes: int = Field(
        default=64 * 1024, ge=4096, description="Largest request head, request line included (431)."
    )
    max_headers: int = Field(default=100, ge=16, description="Most request header fields (431).")
    max_url_bytes: int = Field(default=8 * 1024, ge=256, description="Longest request target (414).")
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds from a new connection, or the first byte of a request, to the end of its "
        "head (408; a connection that sent nothing is closed).",
    )
    keepalive_timeout: float = Field(
        default=75.0, gt=0, description="Seconds an idle client connection is kept open."
    )
    body_timeout: float = Field(
        default=60.0, gt=0, description="Seconds to receive a whole request body (408)."
    )
    max_client_connections: int = Field(
        default=4096,
        ge=16,
        description="Client connections held at once (lowered to fit the open-file limit); past it "
        "the longest-idle connection is closed, or the new one refused when none is idle.",
    )
    max_response_header_bytes: int = Field(
        default=64 * 1024, ge=4096, description="Largest response head from an instance (502)."
    )
    max_response_headers: int = Field(
        default=100, ge=16, description="Most response header fields from an instance (502)."
    )
    max_response_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024 * 1024,
        description="Largest non-stream answer the gateway buffers (502; the instance is not blamed).",
    )
    stream_timeout: float = Field(
        default=3600.0, gt=0, description="Seconds a stream may last in all before it is ended."
    )
    shutdown_timeout: float = Field(default=30.0, ge=0, description="Seconds in-flight work gets on stop.")
    log_format: Literal["text", "json"] = Field(default="text", description="Per-request log line format.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="Logging level."
    )

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        # As an instance's: an OpenAI client's base URL ends in /v1, where the gateway's routes are.
        return check_base_url(v, "[gateway] base_url").removesuffix("/v1")

    @field_validator("api_key_env", "admin_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must name an environment variable (leave admin_key_env out for none)")
        return v

    @model_validator(mode="after")
    def _url_within_head(self) -> GatewaySettings:
        if self.max_url_bytes > self.max_header_bytes:
            raise ValueError(
                f"[gateway] max_url_bytes = {self.max_url_bytes} exceeds max_header_bytes = "
                f"{self.max_header_bytes}: the request line is part of the head"
            )
        return self

    #: Keys the listening socket's protocol is built from: a reload cannot change them.
    LISTENER_KEYS: ClassVar[tuple[str, ...]] = (
        "max_header_bytes",
        "max_headers",
        "max_url_bytes",
        "header_timeout",
        "keepalive_timeout",
        "max_client_connections",
    )

    @property
    def prefix(self) -> str:
        """The path part of base_url ('' or e.g. '/api'), served besides the plain routes."""
        return urlsplit(self.base_url).path.rstrip("/")
