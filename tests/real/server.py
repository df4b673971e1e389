"""Real vLLM OpenAI servers as child processes on 127.0.0.1, through the project's one launcher.

``taogate.bench.procs.launch`` starts each server in a process group of its own, waits until its
``/health`` answers, and stops the whole group (API server, engine core) on the way out; with
``die_with_parent`` the kernel ends it even if the test process is killed outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from taogate.bench.procs import Child, LaunchError, free_port, launch

SERVED_MODEL = "tiny-llama"  # both cards serve it, so the gateway sees one model on two instances
START_TIMEOUT = 240.0  # seconds until /health answers; alone a server needs a few tens of seconds
STOP_TIMEOUT = 20.0  # vLLM's own shutdown (engine core, workers) takes a few seconds
NICENESS = 10  # the servers' scheduling priority below the gateway's and the tests' (see _run)
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
# The test venv's environment must not leak into the vLLM venv's interpreter.
LEAKY_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"

Log = Callable[[str], None]


class ServerError(RuntimeError):
    """A vLLM server did not come up, or died; the message carries the tail of its log."""


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
    kv_replay: bool = False  # with kv_events: answer replay requests on a ROUTER socket of its own
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE=1: /v1/responses keeps responses
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage says cached tokens
    kv_cache_gib: int = 1
    extra_args: tuple[str, ...] = ()


@dataclass
class VllmServer:
    """One running ``vllm.entrypoints.openai.api_server`` (``child`` is set once it is launched)."""

    spec: ServerSpec
    log_path: Path
    port: int = field(default_factory=free_port)
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    child: Child | None = None
    started: float = field(default_factory=time.monotonic)
    ready_after: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where vLLM publishes KV events. vLLM *connects* to a non-wildcard endpoint, so the
        subscriber binds it; events published before the subscriber is there are lost."""
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str | None:
        """Where vLLM binds its replay socket (a subscriber asks it for batches from a sequence)."""
        return None if self.kv_replay_port is None else f"tcp://127.0.0.1:{self.kv_replay_port}"

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
            if self.kv_replay_endpoint is not None:
                config["replay_endpoint"] = self.kv_replay_endpoint
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
            # Its sitecustomize lets the engine use AMX tiles, where the CPU has them.
            PYTHONPATH=str(VLLM_SITE),
        )
        if self.spec.responses_store:
            env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        return env

    def alive(self) -> bool:
        return self.child is not None and self.child.proc.returncode is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, reason: str) -> ServerError:
        where = f"vLLM {self.spec.label} on {self.url}"
        return ServerError(f"{where}: {reason}; log {self.log_path}, its end:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if not self.alive():
            code = None if self.child is None else self.child.proc.returncode
            raise self.failure(f"exited with code {code} during the tests")


async def _run(python: Path, server: VllmServer, stack: contextlib.AsyncExitStack, log: Log) -> None:
    await asyncio.to_thread(server.log_path.write_bytes, b"")
    log(f"started vLLM {server.spec.label} ({server.spec.model.name}) on {server.url}, cpu {server.spec.cpu}")
    launched = launch(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", *server.args()],
        name=f"vLLM {server.spec.label}",
        log=server.log_path,
        env=server.environment(),
        ready_url=server.url,
        ready_within=START_TIMEOUT,
        stop_within=STOP_TIMEOUT,
        die_with_parent=True,
        # The gateway and the load generator share this machine's cores with the servers, whose
        # busy engines would otherwise keep them off the CPU for tenths of a second at a time
        # (their event loop falls behind, every latency they time grows). In production the
        # engines run on hardware of their own; niced, they yield to the gateway as they would.
        niceness=NICENESS,
    )
    try:
        server.child = await stack.enter_async_context(launched)
    except LaunchError as exc:
        raise server.failure(str(exc).splitlines()[0]) from None
    server.ready_after = time.monotonic() - server.started
    log(f"vLLM {server.spec.label} ready after {server.ready_after:.1f} s")


async def start_servers(
    python: Path,
    specs: Sequence[ServerSpec],
    log_dir: Path,
    stack: contextlib.AsyncExitStack,
    *,
    log: Log,
) -> list[VllmServer]:
    """Start every server at once (their start-ups overlap) and wait until all are healthy; each is
    stopped when ``stack`` closes. If one fails, the others' start is cancelled (which stops them)."""
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    servers = [
        VllmServer(
            spec,
            log_dir / f"vllm-{spec.label}.log",
            kv_events_port=free_port() if spec.kv_events else None,
            kv_replay_port=free_port() if spec.kv_events and spec.kv_replay else None,
        )
        for spec in specs
    ]
    async with asyncio.TaskGroup() as group:
        for server in servers:
            group.create_task(_run(python, server, stack, log))
    return servers
