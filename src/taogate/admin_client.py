"""Calls to a running gateway's admin API, for the ``status``, ``drain`` and ``reload`` commands."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["AdminError", "admin_call"]


class AdminError(Exception):
    """The call failed; ``exit_code`` is what the command exits with (3: unreachable, 1: refused)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def admin_call(method: str, url: str, key: str) -> Any:
    """The JSON answer of ``method url`` with the admin key; AdminError otherwise."""
    try:
        r = httpx.request(
            method, url, headers={"authorization": f"Bearer {key}"}, timeout=10, trust_env=False
        )
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach {url}: {exc}", 3) from None
    if r.status_code != 200:
        raise AdminError(f"{url} answered {r.status_code}: {r.text}", 1)
    return r.json()
