"""Child processes for benchmarks and tests: started, awaited until ready, always stopped.

A benchmark that judges a server runs it in a process of its own, so that the server's CPU and
memory are read alone (``cpu_seconds``, ``rss_bytes``) and its event loop is not slowed by the load
generator's. ``launch`` starts one and waits until it is ready, either by the lines it prints
(``ready_prefix``: each such stdout line ends with a URL) or by HTTP (``ready_url``: every path of
``ready_paths`` answers 200). On exit the child gets SIGTERM, then SIGKILL after a bounded wait, or
SIGKILL at once if the block is cancelled; it never outlives the block, and with ``die_with_parent``
not even its parent, should that be killed outright (SIGKILL runs no exit handler). ``niceness``
lowers the child's scheduling priority, and its children's, below the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

__all__ = ["Child", "LaunchError", "child_env", "cpu_seconds", "free_port", "launch", "rss_bytes"]

STOP_TIMEOUT_S = 15.0
_TICKS = os.sysconf("SC_CLK_TCK")


class LaunchError(RuntimeError):
    """The child exited or did not become ready in time; the message ends with its log's tail."""


@dataclass(slots=True)
class Child:
    proc: asyncio.subprocess.Process
    log: Path | None
    urls: list[str] = field(default_factory=list)  # announced by its ready lines, or ``ready_url``

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return self.urls[0]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc/<pid>/stat (fields 14 and 15)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of one process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a child that binds its own socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when the parent dies, however it dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _preexec(die_with_parent: bool, niceness: int) -> Callable[[], None] | None:
    """What the child runs before exec: system calls only, nothing that could deadlock there."""
    if not die_with_parent and niceness <= 0:
        return None

    def run() -> None:
        if die_with_parent:
            _die_with_parent()
        if niceness > 0:
            os.nice(niceness)  # inherited by whatever it starts

    return run


def _nice_session(pid: int, niceness: int) -> None:
    """Where the kernel groups scheduling by session (autogroup), a process's nice value weighs
    only against its own session's: a child in a session of its own competes with the caller's
    as an equal, however nice it is. So the child's session is niced too (best effort: without
    autogroup the file is absent, and the process's own nice value is what counts)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{niceness}\n")


def child_env(env: Mapping[str, str] | None, cwd: Path | None) -> dict[str, str] | None:
    """The environment for a child started in ``cwd``: a relative ``PYTHONPATH`` entry (such as
    ``build/compiled/site``) is made absolute against ours, so the child imports what we meant."""
    if cwd is None:
        return dict(env) if env is not None else None
    out = dict(env if env is not None else os.environ)
    if out.get("PYTHONPATH"):
        parts = out["PYTHONPATH"].split(os.pathsep)
        out["PYTHONPATH"] = os.pathsep.join(str(Path(p).absolute()) if p else p for p in parts)
    return out


def _tail(log: Path | None, n: int = 20) -> str:
    if log is None:
        return ""
    try:
        return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@contextlib.asynccontextmanager
async def launch(
    cmd: Sequence[str],
    *,
    name: str | None = None,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ready_prefix: str | None = None,
    ready_count: int = 1,
    ready_url: str | None = None,
    ready_paths: Sequence[str] = ("/health",),
    ready_within: float = 60.0,
    stop_signal: int = signal.SIGTERM,
    stop_within: float = STOP_TIMEOUT_S,
    die_with_parent: bool = False,
    niceness: int = 0,
) -> AsyncIterator[Child]:
    """Run ``cmd`` until the block exits; ready as the module docstring says. stderr goes to
    ``log`` (or is inherited); stdout is read for the ready lines, then drained into ``log``, or
    without ``ready_prefix`` written there directly. ``stop_within``: seconds the child gets to exit
    after ``stop_signal`` before it is killed."""
    stderr = log.open("ab") if log is not None else None
    if ready_prefix is not None:
        stdout: int | IO[bytes] = asyncio.subprocess.PIPE
    else:
        stdout = stderr if stderr is not None else asyncio.subprocess.DEVNULL
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=child_env(env, cwd),
            cwd=cwd,
            start_new_session=True,  # its own process group: a stop reaches whatever it started
            preexec_fn=_preexec(die_with_parent, niceness),
        )
        if niceness > 0:
            _nice_session(proc.pid, niceness)
    finally:
        if stderr is not None:
            stderr.close()
    child = Child(proc, log)
    name = name or Path(cmd[0]).name
    drain: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(ready_within):
            if ready_prefix is not None:
                child.urls = await _ready_lines(proc, name, ready_prefix, ready_count, log)
                drain = asyncio.get_running_loop().create_task(_drain(proc, log))
            if ready_url is not None:
                await _ready_http(proc, name, ready_url, ready_paths, log)
                child.urls.append(ready_url)
    except TimeoutError:
        await _stop(proc, stop_signal, stop_within)
        raise LaunchError(f"{name} was not ready within {ready_within:g} s{_tail(log)}") from None
    except BaseException:
        await _stop(proc, stop_signal, stop_within)
        raise
    try:
        yield child
    finally:
        await _stop(proc, stop_signal, stop_within)
        if drain is not None:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


async def _ready_lines(
    proc: asyncio.subprocess.Process, name: str, prefix: str, count: int, log: Path | None
) -> list[str]:
    assert proc.stdout is not None
    urls: list[str] = []
    while len(urls) < count:
        line = (await proc.stdout.readline()).decode(errors="replace")
        if not line:
            code = await proc.wait()
            raise LaunchError(f"{name} exited with code {code} before it was ready{_tail(log)}")
        if line.startswith(prefix):
            urls.append(line.split()[-1])
    return urls


async def _drain(proc: asyncio.subprocess.Process, log: Path | None) -> None:
    """Read stdout to its end: a full pipe nobody reads would block the child's event loop."""
    assert proc.stdout is not None
    if log is None:
        while await proc.stdout.read(65536):
            pass
        return
    with log.open("ab") as sink:
        while chunk := await proc.stdout.read(65536):
            sink.write(chunk)


async def _ready_http(
    proc: asyncio.subprocess.Process, name: str, url: str, paths: Sequence[str], log: Path | None
) -> None:
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        for path in paths:
            while True:
                if proc.returncode is not None:
                    raise LaunchError(
                        f"{name} exited with code {proc.returncode} before it was ready{_tail(log)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url + path)).status_code == 200:
                        break
                await asyncio.sleep(0.1)


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(proc: asyncio.subprocess.Process, sig: int, within: float = STOP_TIMEOUT_S) -> None:
    """``sig``, then SIGKILL after a bounded wait; a cancellation meanwhile kills at once."""
    if proc.returncode is not None:
        _signal(proc, signal.SIGKILL)  # whatever it started and left behind
        return
    try:
        _signal(proc, sig)
        async with asyncio.timeout(within):
            await proc.wait()
    except TimeoutError:
        _signal(proc, signal.SIGKILL)
        await proc.wait()
    except asyncio.CancelledError:
        _signal(proc, signal.SIGKILL)
        await asyncio.shield(proc.wait())
        raise
    _signal(proc, signal.SIGKILL)
