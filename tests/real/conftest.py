"""The real-vLLM tier: a fast and a slow real vLLM server on 127.0.0.1, started once per test run.

Every test here is marked ``real_vllm`` (deselect with ``-m 'not real_vllm'``). Its per-test timeout
covers the test function only: the session fixtures install vLLM on a fresh machine and start the
servers, which can take longer than one test may, and are bounded by their own timeouts instead
(pip, the model build, ``/health``). A test that sets its own ``timeout`` marker should pass
``func_only=True`` too, and a function-scoped fixture that starts something must bound its wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.real.home import Prepared, prepare
from tests.real.server import SERVED_MODEL, ServerError, ServerSpec, VllmServer, cpus, start_servers
from tests.real.venv import VenvError

HERE = Path(__file__).resolve().parent
#: Twice what the slowest test took on the machines the tier was timed on: on a machine 2x slower
#: (an EPYC, 2026-12-07) `diagnose` and `bench --compare` passed 120 s.
TEST_TIMEOUT = 240.0
REPORT = pytest.StashKey[list[str]]()

Say = Callable[[str], None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.real_vllm)
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT, func_only=True))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.section("real vLLM")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def say(pytestconfig: pytest.Config) -> Say:
    """Print a progress line now, past output capture: a fresh install is minutes of silence otherwise."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    terminal = pytestconfig.pluginmanager.getplugin("terminalreporter")

    def emit(message: str) -> None:
        if capture is None or terminal is None:
            return
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"[real-vllm] {message}")

    return emit


@pytest.fixture(scope="session")
def report(pytestconfig: pytest.Config, say: Say) -> Say:
    """Like ``say``, and the line is repeated in the summary at the end of the run (timings, ratios)."""
    kept = pytestconfig.stash.setdefault(REPORT, [])

    def emit(message: str) -> None:
        kept.append(message)
        say(message)

    return emit


@pytest.fixture(scope="session")
def prepared(say: Say, report: Say) -> Prepared:
    """The vLLM venv and the tiny models (installed and built on first use, then cached)."""
    try:
        ready = prepare(say)
    except (VenvError, RuntimeError) as exc:
        pytest.fail(str(exc), pytrace=False)
    report(f"venv ready in {ready.timings['venv']:.1f} s, models in {ready.timings['models']:.1f} s")
    return ready


@dataclass(frozen=True)
class Pair:
    """Two real vLLM servers serving one model name: a fast card and a slow (wider, deeper) one."""

    fast: VllmServer
    slow: VllmServer
    tokenizer_json: Path
    model: str = SERVED_MODEL

    @property
    def servers(self) -> tuple[VllmServer, VllmServer]:
        return self.fast, self.slow


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def vllm_pair(prepared: Prepared, say: Say, report: Say) -> AsyncIterator[Pair]:
    """The fast and the slow card, each bound to a core of its own, started together.

    Package scope: started once for this tier and stopped when its last test is done, so the rest of
    the suite does not run beside two idle engines holding their memory. The servers live on the
    package's event loop; tests on their own loops only talk to them over HTTP."""
    cores = cpus()
    specs = [
        # KV events (and their replay socket) cost the engine next to nothing and let tests watch
        # its prefix cache directly, and the gateway index it (precise mode).
        # The Responses store costs nothing until a Responses request and lets stored ones chain.
        ServerSpec(
            "fast",
            prepared.models.dirs["fast"],
            cpu=cores[0],
            kv_events=True,
            kv_replay=True,
            responses_store=True,
        ),
        ServerSpec(
            "slow",
            prepared.models.dirs["slow"],
            cpu=cores[1 % len(cores)],
            kv_events=True,
            kv_replay=True,
            responses_store=True,
        ),
    ]
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        try:
            fast, slow = await start_servers(prepared.python, specs, prepared.logs, stack, log=say)
        except ExceptionGroup as group:
            failed = group.subgroup(ServerError)
            if failed is None:
                raise
            pytest.fail("\n".join(str(exc) for exc in failed.exceptions), pytrace=False)
        report(f"servers ready in {time.monotonic() - started:.1f} s (started together)")
        yield Pair(fast, slow, prepared.models.tokenizer_json)


@pytest.fixture(params=["fast", "slow"])
def card(request: pytest.FixtureRequest, vllm_pair: Pair) -> VllmServer:
    """Each card in turn; a server that died earlier fails the test with its log's tail."""
    server: VllmServer = getattr(vllm_pair, request.param)
    try:
        server.check_alive()
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    return server


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        yield client
