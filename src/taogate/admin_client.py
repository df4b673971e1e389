"""Calls to a running gateway's admin API, for the ``status``, ``drain`` and ``reload`` commands."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

__all__ = ["AdminError", "admin_call", "interrupts_held"]


class AdminError(Exception):
    """The call failed; ``exit_code`` is what the command exits with (3: unreachable, 1: refused)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def admin_call(method: str, url: str, key: str) -> Any:
    """The JSON answer of ``method url`` with the admin key; AdminError otherwise."""
    try:
        with interrupts_held():
            r = httpx.request(
                method, url, headers={"authorization": f"Bearer {key}"}, timeout=10, trust_env=False
            )
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach {url}: {exc}", 3) from None
    if r.status_code != 200:
        raise AdminError(f"{url} answered {r.status_code}: {r.text}", 1)
    return r.json()


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C inside the block is raised when the block ends, over any error the block raised (a
    call that failed meanwhile must not swallow it). Raised inside httpx's client, it can leave its
    connection pool's lock held, and the close that follows then waits on that lock for ever
    (``status --watch`` once did not exit). The call's timeout bounds the wait. Outside the main
    thread, where signals are not handled, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = False

    def hold(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupted:
            raise KeyboardInterrupt  # over the block's own error, as Ctrl-C means to
