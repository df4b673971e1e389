"""``python -m taogate.emulator`` as a separate process: ready line, serving, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx


async def test_standalone_process_serves_and_exits_cleanly() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "taogate.emulator",
        "--port",
        "0",
        "--fleet",
        "2",
        "--slow",
        "1=2.5",
        "--enable-prefix-caching",
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        lines = [await asyncio.wait_for(proc.stdout.readline(), timeout=20) for _ in range(2)]
        urls = [line.decode().split()[-1] for line in lines]
        assert all(line.startswith(b"emulator ready http://127.0.0.1:") for line in lines)
        async with httpx.AsyncClient() as http:
            for url in urls:
                r = await http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 200
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 0, err.decode()
