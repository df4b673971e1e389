"""One stack for the Envoy tier's module: three emulated instances (the last four times slower),
``taogate pick`` (the unified key and one named key) and Envoy with the shipped bootstrap, fail
closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from taogate.bench.procs import Child, free_port
from tests.envoy import stack

SLOW = 2  # index of the slow instance; its name is emu2
#: A named key beside the unified one, two requests a minute.
TEAM_A_KEY = "team-a-secret"
TEAM_A_TOML = '[[keys]]\nname = "team-a"\nkey_env = "TEAM_A_KEY"\nrequests_per_minute = 2\n'


@dataclass(frozen=True, slots=True)
class Stack:
    workdir: Path
    fleet: Child
    config: Path
    picker: stack.Picker
    envoy: stack.Envoy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def envoy_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("envoy")
    args = ["--slow", f"{SLOW}=4", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    async with stack.fleet(workdir / "fleet.log", 3, args) as fleet:
        config = workdir / "config.toml"
        stack.write_config(config, fleet.urls, TEAM_A_TOML)
        async with stack.picker(workdir, config, environ={"TEAM_A_KEY": TEAM_A_KEY}) as picker:
            doc = stack.bootstrap(free_port(), free_port(), [picker.port])
            async with stack.envoy(workdir, doc) as envoy:
                yield Stack(workdir, fleet, config, picker, envoy)
