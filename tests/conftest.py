"""Shared fixtures: emulated vLLM instances and a real gateway, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest

import taogate
from taogate.app import RunningGateway, serve_gateway
from taogate.bench.scenarios import loopback_settings
from taogate.build import build_of
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import Fleet, run_fleet
from taogate.settings import Settings

#: The compiled build (``make compiled``) is what the tests import: its classes are closed.
COMPILED = build_of("taogate.fleet.instance") == "compiled"


def pytest_configure(config: pytest.Config) -> None:
    """``make check-compiled`` says it wants the compiled build: refuse to test the Python one.

    A suite started in the background by a shell without job control (``make check &``, a script)
    inherits SIGINT ignored, and Python then raises no KeyboardInterrupt, nor do the CLI processes
    the tests start: the tests that press Ctrl-C get what a terminal gives instead."""
    if os.environ.get("TAOGATE_EXPECT_COMPILED") == "1" and not COMPILED:
        raise pytest.UsageError(f"TAOGATE_EXPECT_COMPILED=1, but taogate is imported from {taogate.__file__}")
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under the compiled build, skip the tests marked ``python_only``: they subclass a class of ours
    or set a method on one (to hold a rewrite to the code it replaced, or to plant a fault), which a
    compiled class refuses."""
    if COMPILED:
        skip = pytest.mark.skip(reason="changes a class at run time, which the compiled build refuses")
        for item in items:
            if item.get_closest_marker("python_only"):
                item.add_marker(skip)


def missing(what: str, *, hint: str, required_in_ci: bool = True) -> NoReturn:
    """A tool a test needs is not here: fail under CI (``.ci/run`` installs it), skip elsewhere."""
    if required_in_ci and os.environ.get("CI"):
        pytest.fail(f"{what} is missing under CI: {hint}")
    pytest.skip(f"{what} not available ({hint})")


def require_tool(name: str, *, hint: str, required_in_ci: bool = True) -> str:
    """The path of command ``name`` on PATH, or ``missing``."""
    path = shutil.which(name)
    if path is None:
        missing(name, hint=hint, required_in_ci=required_in_ci)
    return path


KEY = "test-unified-key"
ENV = {"TAOTOKEN_API_KEY": KEY}

# Real uvicorn servers on loopback: no proxy from the environment may intercept them.
for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)
os.environ["NO_PROXY"] = "127.0.0.1,localhost"


@dataclass(frozen=True, slots=True)
class Running(RunningGateway):
    """A gateway in front of an emulated fleet."""

    fleet: Fleet


def gateway_settings(
    urls: Sequence[str],
    *,
    roles: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    **sections: dict[str, Any],
) -> Settings:
    """Settings for tests: the loopback defaults, a short request timeout and no warm-up probes
    (tests count the requests each emulator saw); sections override."""
    gateway = {"request_timeout": 30, "shutdown_timeout": 5, **sections.pop("gateway", {})}
    dispatch = {"health_timeout": 1.0, "warmup_tokens": 0, **sections.pop("dispatch", {})}
    return loopback_settings(urls, names=names, roles=roles, gateway=gateway, dispatch=dispatch, **sections)


def serve(settings: Settings) -> AbstractAsyncContextManager[RunningGateway]:
    """A real gateway on a free loopback port with the tests' key; lifespan done on entry."""
    return serve_gateway(settings, key=KEY)


@asynccontextmanager
async def running_gateway(
    configs: list[EmulatorConfig],
    *,
    names: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
    **sections: dict[str, Any],
) -> AsyncIterator[Running]:
    async with (
        run_fleet(configs) as fleet,
        serve(gateway_settings(fleet.urls, roles=roles, names=names, **sections)) as g,
    ):
        yield Running(g.url, g.key, g.app, fleet)


async def wait_until(predicate: Callable[[], bool], within: float = 5.0, what: str = "condition") -> None:
    """Poll in-process server state every few ms, up to ``within`` seconds (bounded; never a bare sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not met within {within:g}s")
        await asyncio.sleep(0.005)


GatewayFactory = Callable[..., AbstractAsyncContextManager[Running]]


@pytest.fixture
def gateway_factory() -> GatewayFactory:
    return running_gateway


@pytest.fixture
async def gw() -> AsyncIterator[Running]:
    """A gateway in front of two default emulated instances (prefix caching on)."""
    configs = [EmulatorConfig(enable_prefix_caching=True, seed=i) for i in range(2)]
    async with running_gateway(configs) as running:
        yield running
