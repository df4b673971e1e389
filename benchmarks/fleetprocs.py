"""Processes for the benchmarks: emulators and gateways in their own processes, so each one's CPU and
memory are read from /proc alone; all on 127.0.0.1, always stopped (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 60.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc/<pid>/stat (fields 14 and 15)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of one process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM, then SIGKILL after a bounded wait; never leaves the child behind."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_emulators(
    count: int, log: Path, args: tuple[str, ...] = ("--instant",)
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """``count`` emulators in one process on free ports; returns it and their URLs once all listen."""
    cmd = [sys.executable, "-m", "taogate.emulator", "--fleet", str(count), "--port", "0", *args]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), cwd=ROOT)
    urls: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        while len(urls) < count:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"emulators did not start ({len(urls)}/{count} ready):\n{tail(log)}")
            readable, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not readable:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                continue  # EOF: poll() above reports the exit
            buf += chunk
            *lines, buf = buf.split(b"\n")
            urls += [ln.split()[-1].decode() for ln in lines if ln.startswith(b"emulator ready ")]
    except BaseException:
        stop_process(proc)
        raise
    return proc, urls


def write_config(
    path: Path, urls: list[str], log_level: str, extra: str = "", max_connections: int = 64
) -> None:
    """A gateway config.toml for ``urls``; ``extra`` is appended (e.g. a [dispatch] table)."""
    instances = "".join(f'\n[[instances]]\nurl = "{u}"\nname = "emu{i}"\n' for i, u in enumerate(urls))
    path.write_text(
        "[gateway]\n"
        'base_url = "http://127.0.0.1:8080"\n'
        'api_key_env = "TAOTOKEN_API_KEY"\n'
        "request_timeout = 120\n"
        f"max_connections = {max_connections}\n"
        f'log_level = "{log_level}"\n' + extra + instances
    )


def start_gateway(
    workdir: Path, urls: list[str], log_level: str, api_key: str, extra: str = "", max_connections: int = 64
) -> tuple[subprocess.Popen[bytes], str]:
    """``taogate serve`` in its own process (so its CPU and memory are measured alone)."""
    cfg = workdir / f"config-{log_level}.toml"
    write_config(cfg, urls, log_level, extra, max_connections)
    port = free_port()
    log = workdir / f"gateway-{log_level}.log"
    env = {**os.environ, "TAOTOKEN_API_KEY": api_key}
    exe = str(Path(sys.executable).with_name("taogate"))
    cmd = [exe, "serve", "--config", str(cfg), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env, cwd=workdir)
    return proc, f"http://127.0.0.1:{port}"


NGINX_CONF = """\
daemon off;
master_process off;  # one process, so its CPU is read from one /proc/<pid>/stat
worker_processes 1;
pid {workdir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    upstream emulators {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /health {{ return 200; }}
        location = /ready {{ return 200; }}
        location / {{
            proxy_pass http://emulators;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_reference(workdir: Path, urls: list[str], client: str) -> tuple[subprocess.Popen[bytes], str]:
    """One of issue 3's reference proxies: ``reference_proxy.py`` (FastAPI + ``client``, no logic), or
    nginx (``client="nginx"``, round robin over keep-alive upstream connections)."""
    port = free_port()
    log = workdir / f"reference-{client}.log"
    if client == "nginx":
        conf = workdir / "nginx.conf"
        servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in urls)
        conf.write_text(NGINX_CONF.format(workdir=workdir, servers=servers, port=port))
        cmd = ["nginx", "-p", str(workdir), "-e", "stderr", "-c", str(conf)]
    else:
        script = str(ROOT / "benchmarks" / "reference_proxy.py")
        cmd = [sys.executable, script, "--client", client, "--port", str(port), *urls]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=workdir)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """GET /health = 200 (listening), then /ready = 200 (instances probed and their models known)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for path in ("/health", "/ready"):
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server at {url} not ready ({path}):\n{tail(log)}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url + path) as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.1)
