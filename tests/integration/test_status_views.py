"""The live views without a browser: ``taogate status`` at 80 columns, ``--watch`` in a real pseudo
terminal, ``GET /admin/history`` and the page's headers."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import hashlib
import os
import pty
import re
import signal
import struct
import sys
import termios

import httpx
from rich.cells import cell_len
from typer.testing import CliRunner

from taogate.cli import app
from taogate.observe.dashboard import page
from tests.conftest import KEY, Running, wait_until

AUTH = {"authorization": f"Bearer {KEY}"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


async def _requests(gw: Running, n: int) -> None:
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as h:
        for i in range(n):
            body = {"model": "emulated-model", "prompt": f"hello {i}", "max_tokens": 2}
            assert (await h.post(gw.api_base + "/completions", json=body)).status_code == 200


async def test_plain_status_fits_80_columns_without_cutting_a_header(gw: Running) -> None:
    await _requests(gw, 4)
    result = await asyncio.to_thread(
        CliRunner().invoke, app, ["status", "--url", gw.url, "--key", KEY], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(cell_len(line) <= 80 for line in lines), lines
    assert "…" not in result.stdout
    header = next(line for line in lines if "instance" in line)
    for title in ("instance", "in flight", "TTFT p99", "speed", "verdict"):
        assert title in header, header
    assert "least_busy" in result.stdout


async def test_status_watch_redraws_in_place_within_80_columns(gw: Running) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {**os.environ, "COLUMNS": "80", "LINES": "40", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "taogate.cli",
        "status",
        "--watch",
        "--interval",
        "0.3",
        "--url",
        gw.url,
        "--key",
        KEY,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    out = bytearray()
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            out.extend(os.read(master, 65536))
        except OSError:  # the other side closed
            loop.remove_reader(master)

    loop.add_reader(master, readable)
    try:
        await wait_until(lambda: out.count("┏".encode()) >= 2, within=30, what="two frames drawn")
        frames_before = out.count("┏".encode())
        await _requests(gw, 3)
        await wait_until(lambda: out.count("┏".encode()) >= frames_before + 2, within=30, what="redrawn")
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 20)
        loop.remove_reader(master)
        os.close(master)
    assert code == 0
    text = out.decode(errors="replace")
    assert "\x1b[1A" in text or "\x1b[A" in text  # the cursor goes back up: redrawn in place
    plain = ANSI.sub("", text)
    lines = [seg for line in plain.replace("\r", "\n").split("\n") for seg in [line] if seg.strip()]
    assert all(cell_len(line) <= 80 for line in lines), max(lines, key=cell_len)
    assert "…" not in plain
    assert "in flight" in plain and "i0" in plain and "i1" in plain
    assert "Ctrl-C" in plain.rsplit("┏", 1)[1]


async def test_history_is_served_in_frames_and_increments(gw: Running) -> None:
    async with httpx.AsyncClient(timeout=10) as anon:
        r = await anon.get(gw.url + "/admin/history")
        assert r.status_code == 401 and r.json()["error"]["type"]
    async with httpx.AsyncClient(headers=AUTH, timeout=10) as h:
        await wait_until(lambda: len(gw.gateway.history) >= 2, within=10, what="two frames sampled")
        full = (await h.get(gw.url + "/admin/history")).json()
        assert full["capacity"] == 300 and full["interval"] == 1.0
        assert len(full["t"]) >= 2 and sorted(full["instances"]) == ["i0", "i1"]
        for series in full["instances"].values():
            assert set(series) == {"inflight", "waiting", "ttft_p99", "rps"}
            assert all(len(v) == len(full["t"]) for v in series.values())
        newer = (await h.get(gw.url + "/admin/history", params={"since": full["t"][-1]})).json()
        assert all(t > full["t"][-1] for t in newer["t"])
        bad = await h.get(gw.url + "/admin/history", params={"since": "yesterday"})
        assert bad.status_code == 400 and "since" in bad.json()["error"]["message"]
        rows = (await h.get(gw.url + "/admin/instances")).json()
        assert rows["gateway"]["strategy"] == "least_busy"
        assert {r["state"] for r in rows["instances"]} == {"ok"}


async def test_the_page_is_served_with_a_strict_policy(gw: Running) -> None:
    async with httpx.AsyncClient(timeout=10) as h:
        r = await h.get(gw.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.content == page() and b"http" not in re.sub(rb"http://www\.w3\.org/2000/svg", b"", r.content)
    csp = r.headers["content-security-policy"]
    # Exactly the inline script and style run: each allowed by its hash, nothing else.
    html = r.text
    for kind in ("script", "style"):
        body = re.search(rf"<{kind}>(.*?)</{kind}>", html, re.DOTALL)
        assert body is not None
        digest = base64.b64encode(hashlib.sha256(body.group(1).encode()).digest()).decode()
        assert f"{kind}-src 'sha256-{digest}'" in csp
    assert "'unsafe-inline'" not in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"
    assert "set-cookie" not in r.headers
    # Under the base_url's path too, where its relative calls reach that path's admin routes.
    async with httpx.AsyncClient(timeout=10) as h:
        assert (await h.get(gw.url + "/api/dashboard")).content == page()
        assert (await h.get(gw.url + "/api/admin/history", headers=AUTH)).status_code == 200
