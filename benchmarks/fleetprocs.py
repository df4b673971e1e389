"""The benchmarks' servers, each in a process of its own (``taogate.bench.procs.launch``), so each
one's CPU and memory are read from /proc alone; all on 127.0.0.1, always stopped."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from peers import router_command, router_env

from taogate.bench.procs import Child, free_port, launch

ROOT = Path(__file__).resolve().parent.parent
#: The Rust routers as reference proxies, each with the policy the overhead table names.
ROUTER_POLICIES = {"vllm-router": "power_of_two", "sglang-router": "cache_aware"}


def emulators(
    count: int, log: Path, args: tuple[str, ...] = ("--instant",)
) -> AbstractAsyncContextManager[Child]:
    """``count`` emulators in one process on free ports; ``Child.urls`` once all listen."""
    cmd = [sys.executable, "-m", "taogate.emulator", "--fleet", str(count), "--port", "0", *args]
    cmd += ["--log-level", "warning"]
    return launch(cmd, name="emulators", log=log, cwd=ROOT, ready_prefix="emulator ready ", ready_count=count)


def write_config(
    path: Path,
    urls: list[str],
    log_level: str,
    extra: str = "",
    max_connections: int | None = None,
    instance_extra: Sequence[str] = (),
) -> None:
    """A gateway config.toml for ``urls``; ``extra`` is appended (e.g. a [dispatch] table), and
    ``instance_extra[i]`` to instance ``i``'s table."""
    more = list(instance_extra) + [""] * (len(urls) - len(instance_extra))
    instances = "".join(
        f'\n[[instances]]\nurl = "{u}"\nname = "emu{i}"\n{more[i]}' for i, u in enumerate(urls)
    )
    path.write_text(
        "[gateway]\n"
        'base_url = "http://127.0.0.1:8080"\n'
        'api_key_env = "TAOTOKEN_API_KEY"\n'
        "request_timeout = 120\n"
        + (f"max_connections = {max_connections}\n" if max_connections else "")
        + f'log_level = "{log_level}"\n'
        + extra
        + instances
    )


def gateway(
    workdir: Path,
    urls: list[str],
    log_level: str,
    api_key: str,
    extra: str = "",
    max_connections: int | None = None,
    instance_extra: Sequence[str] = (),
    wrapper: Sequence[str] = (),
    ready_within: float = 60.0,
) -> AbstractAsyncContextManager[Child]:
    """``taogate serve``, as users run it; ready once ``/ready`` says its instances are probed.
    ``wrapper`` goes before the command (a profiler: ``valgrind --tool=callgrind ...``)."""
    cfg = workdir / f"config-{log_level}.toml"
    write_config(cfg, urls, log_level, extra, max_connections, instance_extra)
    port = free_port()
    env = {**os.environ, "TAOTOKEN_API_KEY": api_key}
    exe = str(Path(sys.executable).with_name("taogate"))
    cmd = [*wrapper, exe, "serve", "--config", str(cfg), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"gateway-{log_level}.log"
    return launch(
        cmd,
        name="taogate serve",
        log=log,
        env=env,
        cwd=workdir,
        ready_url=url,
        ready_paths=READY,
        ready_within=ready_within,
    )


#: GET /health = 200 (listening), then /ready = 200 (instances probed and their models known).
READY = ("/health", "/ready")

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
        least_conn;
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


def reference(
    workdir: Path, urls: list[str], client: str, wrapper: Sequence[str] = ()
) -> AbstractAsyncContextManager[Child]:
    """A reference proxy: ``reference_proxy.py`` (FastAPI + ``client``, or ``bare``: taogate's own
    listener and ``h1`` with no logic), nginx (``client="nginx"``, ``least_conn`` over keep-alive
    upstream connections), or a Rust router (``ROUTER_POLICIES``). ``wrapper`` goes before a
    Python proxy's command (a profiler)."""
    port = free_port()
    log = workdir / f"reference-{client}.log"
    ready: Sequence[str] = READY
    env: dict[str, str] | None = None
    if client in ROUTER_POLICIES:
        cmd = router_command(client, urls, port, ROUTER_POLICIES[client])
        ready, env = ("/health",), router_env()  # a router passes /ready on to a worker
    elif client == "nginx":
        conf = workdir / "nginx.conf"
        servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in urls)
        conf.write_text(NGINX_CONF.format(workdir=workdir, servers=servers, port=port))
        cmd = ["nginx", "-p", str(workdir), "-e", "stderr", "-c", str(conf)]
    else:
        script = str(ROOT / "benchmarks" / "reference_proxy.py")
        cmd = [*wrapper, sys.executable, script, "--client", client, "--port", str(port), *urls]
    url = f"http://127.0.0.1:{port}"
    within = 600.0 if wrapper else 60.0  # a profiler slows the start down
    return launch(
        cmd,
        name=f"reference {client}",
        log=log,
        cwd=workdir,
        ready_url=url,
        ready_paths=ready,
        ready_within=within,
        env=env,
    )
