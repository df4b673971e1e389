"""The peer routers, as rows of our own dispatch benchmark: each one started on 127.0.0.1 in front of
the same emulated fleet as taogate's rows, as a subprocess that stops with the block.

- ``sglang-router`` (the SGLang gateway, from PyPI) and ``vllm-router`` (from PyPI), each with its
  ``cache_aware`` policy: a radix tree of the prompts it sent to each worker picks the worker with
  the longest match above ``--cache-threshold``, unless the load (requests in flight) is imbalanced
  past both ``--balance-abs-threshold`` and ``--balance-rel-threshold``, then the least loaded.
  Their defaults (0.3, 64, 1.5) are kept except the absolute threshold, set to ``BALANCE_ABS``: at
  64, a run of 16-32 clients on four instances never counts as imbalanced, and one hot prefix
  piles every request onto one worker (measured: all 64 long prompts on the slow card).
- ``nginx`` (Debian's) with ``least_conn`` over keep-alive upstream connections, one worker, no
  root-owned files: its pid file and temp directories live in the run's own directory.

``PEERS`` names them; ``peer(name, urls, workdir)`` starts one and yields its base URL.
``router_command`` is a router's command line with another policy (``overhead.py``'s references).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from taogate.bench.procs import free_port, launch

__all__ = ["PEERS", "available", "nginx_conf", "peer", "router_command", "router_env"]

PEERS = ("sglang-router cache_aware", "vllm-router cache_aware", "nginx least_conn")
BALANCE_ABS = 4  # requests in flight: the imbalance past which the routers take the least loaded

NGINX_LEAST_CONN = """\
daemon off;
master_process off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    upstream fleet {{
        least_conn;
{servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /health {{ return 200; }}
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_conf(workdir: Path, urls: Sequence[str], port: int) -> str:
    """nginx's configuration: ``least_conn`` over ``urls`` on 127.0.0.1:``port``, files in ``workdir``."""
    servers = "\n".join(f"        server {u.removeprefix('http://')} max_fails=0;" for u in urls)
    return NGINX_LEAST_CONN.format(workdir=workdir, servers=servers, port=port)


def _router(module: str) -> list[str] | None:
    """The command that runs a router package's launcher with this interpreter (None: not installed)."""
    try:
        __import__(module)
    except ImportError:
        return None
    return [sys.executable, "-m", f"{module}.launch_router"]


def available(name: str) -> bool:
    """Whether this peer can run here (its package installed, or nginx on the PATH)."""
    if name.startswith("nginx"):
        return shutil.which("nginx") is not None
    return _router(name.split(maxsplit=1)[0].replace("-", "_")) is not None


def router_command(package: str, urls: Sequence[str], port: int, policy: str) -> list[str]:
    """The command that runs ``package`` (``sglang-router`` or ``vllm-router``) with ``policy`` in
    front of ``urls`` on 127.0.0.1:``port``."""
    module = package.replace("-", "_")
    cmd = _router(module)
    if cmd is None:
        raise RuntimeError(f"{package}: not installed (the bench extra has it)")
    return [
        *cmd,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *urls,
        "--policy", policy,
        "--balance-abs-threshold", str(BALANCE_ABS),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
        "--log-level", "warn" if module == "sglang_router" else "warning",
    ]  # fmt: skip


def router_env() -> dict[str, str]:
    """A router's environment: vllm-router logs each pick at INFO whatever its ``--log-level``,
    unless ``RUST_LOG`` says otherwise."""
    return {**os.environ, "RUST_LOG": "warn"}


def _command(name: str, urls: Sequence[str], workdir: Path, port: int) -> list[str]:
    if name.startswith("nginx"):
        conf = workdir / "nginx.conf"
        conf.write_text(nginx_conf(workdir, urls, port))
        return ["nginx", "-p", str(workdir), "-e", "stderr", "-c", str(conf)]
    return router_command(name.split(maxsplit=1)[0], urls, port, "cache_aware")


@contextlib.asynccontextmanager
async def peer(name: str, urls: Sequence[str], workdir: Path) -> AsyncIterator[str]:
    """Run the peer ``name`` in front of ``urls`` until the block exits; yields its base URL.
    ``workdir`` (an existing directory) takes its configuration, logs and temp files."""
    port = free_port()
    cmd = _command(name, urls, workdir, port)
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{name.split(maxsplit=1)[0]}.log"
    env = None if name.startswith("nginx") else router_env()
    async with launch(cmd, name=name, log=log, cwd=workdir, ready_url=url, ready_within=60.0, env=env):
        yield url
