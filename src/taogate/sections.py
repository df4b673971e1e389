"""What every config section shares: strict keys, and the check of a base URL."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

__all__ = ["Section", "check_base_url"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_base_url(value: str, key: str) -> str:
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
