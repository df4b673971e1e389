"""Shared fixtures: emulated vLLM instances and a real gateway, all on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest

from taogate.app import TaogateApp, create_app
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import Fleet, run_fleet
from taogate.serving import serve_asgi
from taogate.settings import Settings


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


@dataclass
class Gate:
    """One running gateway: its URL and its in-process app."""

    url: str  # http://127.0.0.1:PORT
    app: TaogateApp

    @property
    def api(self) -> str:
        return self.url + "/v1"

    @property
    def gateway(self) -> Any:
        return self.app.gateway


@dataclass
class Running(Gate):
    """A gateway in front of an emulated fleet."""

    fleet: Fleet


def gateway_settings(
    urls: Sequence[str],
    *,
    roles: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    **sections: dict[str, Any],
) -> Settings:
    """Settings for tests: fast probes and scrapes, the given instances (named i0, i1, ... unless
    ``names``; with ``roles``, long/short/any each); sections override."""
    instances: list[dict[str, Any]] = []
    for n, url in enumerate(urls):
        item: dict[str, Any] = {"url": url, "name": names[n] if names else f"i{n}"}
        if roles is not None:
            item["role"] = roles[n]
        instances.append(item)
    data: dict[str, Any] = {
        "gateway": {"base_url": "http://127.0.0.1:8080/api", "request_timeout": 30, "shutdown_timeout": 5},
        # No warm-up probes by default: tests count the requests each emulator saw.
        "dispatch": {
            "health_check_interval": 0.5,
            "scrape_interval": 0.2,
            "health_timeout": 1.0,
            "warmup_tokens": 0,
        },
        "instances": instances,
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Settings(**data)


@asynccontextmanager
async def running_gateway(
    configs: list[EmulatorConfig], **sections: dict[str, Any]
) -> AsyncIterator[Running]:
    async with run_fleet(configs) as fleet:
        app = create_app(gateway_settings(fleet.urls, **sections), environ=ENV)
        async with serve_asgi(app) as served:
            yield Running(served.url, app, fleet)


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
