"""Real vLLM OpenAI servers as subprocesses on 127.0.0.1: start, wait until healthy, stop for sure."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

SERVED_MODEL = "tiny-llama"  # both cards serve it, so the gateway sees one model on two instances
START_TIMEOUT = 240.0  # seconds until /health answers; alone a server needs a few tens of seconds
STOP_TIMEOUT = 20.0
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
# The test venv's environment must not leak into the vLLM venv's interpreter.
LEAKY_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")

Log = Callable[[str], None]


class ServerError(RuntimeError):
    """A vLLM server did not come up, or died; the message carries the tail of its log."""


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick; a small race we accept on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ServerSpec:
    """How to run one vLLM server; ``cpu`` is the core its engine's OpenMP threads are bound to."""

    label: str
    model: Path
    cpu: int
    served_model_name: str = SERVED_MODEL
    max_num_seqs: int = 2  # small, so that concurrent requests queue as on a loaded card
    kv_events: bool = False  # publish KV-cache events over ZMQ to tcp://127.0.0.1:<port>
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE=1: /v1/responses keeps responses
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage says cached tokens
    kv_cache_gib: int = 1
    extra_args: tuple[str, ...] = ()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies, even by SIGKILL."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class VllmServer:
    """One running ``vllm.entrypoints.openai.api_server`` in a process group of its own."""

    def __init__(self, python: Path, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events_port = free_port() if spec.kv_events else None
        self.log_path = log_dir / f"vllm-{spec.label}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [str(python), "-m", "vllm.entrypoints.openai.api_server", *self.args()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # one group: the API server, its engine core and workers
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call, no locks taken
            )
        self.started = time.monotonic()
        self.ready_after: float | None = None

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where vLLM publishes KV events. vLLM *connects* to a non-wildcard endpoint, so the
        subscriber binds it; events published before the subscriber is there are lost."""
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"

    def args(self) -> list[str]:
        spec = self.spec
        args = [
            "--model", str(spec.model),
            "--served-model-name", spec.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--enforce-eager",  # no graph compilation: ready in about half the time
            "--enable-prefix-caching",
            "--max-num-seqs", str(spec.max_num_seqs),
        ]  # fmt: skip
        if spec.prompt_tokens_details:
            args.append("--enable-prompt-tokens-details")
        if self.kv_events_endpoint is not None:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": "kv",
            }
            args += ["--kv-events-config", json.dumps(config)]
        return [*args, *spec.extra_args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS + LEAKY_VARS}
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=str(self.spec.cpu),
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # vLLM's own IPC would otherwise pick the machine's external address.
            VLLM_HOST_IP="127.0.0.1",
            VLLM_LOOPBACK_IP="127.0.0.1",
            NO_PROXY="127.0.0.1,localhost",
            PYTHONUNBUFFERED="1",
        )
        if self.spec.responses_store:
            env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        return env

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, reason: str) -> ServerError:
        where = f"vLLM {self.spec.label} on {self.url}"
        return ServerError(f"{where}: {reason}; log {self.log_path}, its end:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """One probe of ``GET /health``; raises if the process has exited."""
        if not self.alive():
            raise self.failure(f"exited with code {self.process.returncode}")
        try:
            return httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self) -> None:
        if not self.alive():
            raise self.failure(f"exited with code {self.process.returncode} during the tests")

    def stop(self) -> None:
        """SIGTERM the whole group, give vLLM time to shut down cleanly, then SIGKILL what is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_TIMEOUT)
        # The leader may be gone while its engine core still runs: wait for the group, then kill it.
        deadline = time.monotonic() + 5.0
        while _group_exists(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_servers(
    python: Path, specs: Sequence[ServerSpec], log_dir: Path, *, log: Log, timeout: float = START_TIMEOUT
) -> list[VllmServer]:
    """Start every server at once (their start-ups overlap), then wait until all are healthy.

    On any failure every server started here is stopped before the error propagates."""
    servers: list[VllmServer] = []
    try:
        for spec in specs:
            servers.append(VllmServer(python, spec, log_dir))
            log(f"started vLLM {spec.label} ({spec.model.name}) on {servers[-1].url}, cpu {spec.cpu}")
        deadline = time.monotonic() + timeout
        waiting = list(servers)
        while waiting:
            for server in list(waiting):
                if server.healthy():
                    server.ready_after = time.monotonic() - server.started
                    log(f"vLLM {server.spec.label} ready after {server.ready_after:.1f} s")
                    waiting.remove(server)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise waiting[0].failure(f"/health did not answer 200 within {timeout:.0f} s")
            time.sleep(0.25)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
