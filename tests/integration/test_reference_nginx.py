"""overhead.py's nginx reference row: Debian's nginx, ``least_conn`` over the emulators, on loopback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleetprocs import emulators, reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx not installed (.ci/run installs it)"
)


async def test_nginx_spreads_by_least_conn_over_the_emulators(tmp_path: Path) -> None:
    async with emulators(2, tmp_path / "emulators.log") as emu, reference(tmp_path, emu.urls, "nginx") as ngx:
        conf = (tmp_path / "nginx.conf").read_text()
        assert "least_conn;" in conf and str(tmp_path / "nginx.pid") in conf  # no root pid file
        body = {"model": "emulated-model", "prompt": "hi", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=ngx.url, trust_env=False) as client:
            answers = [await client.post("/v1/completions", json=body) for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        async with httpx.AsyncClient(trust_env=False) as client:
            served = [(await client.get(url + "/emulator/stats")).json()["requests_seen"] for url in emu.urls]
        assert sum(served) >= 6 and all(n > 0 for n in served)  # one at a time: ties go round the servers
