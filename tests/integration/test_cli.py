"""The taogate command: check-config, init, status/drain, and serve as a real process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import tomllib
from pathlib import Path

import httpx
from typer.testing import CliRunner

from taogate.cli import app
from taogate.serving import bind_socket
from tests.conftest import KEY, Running

runner = CliRunner()


def test_check_config_prints_effective_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[dispatch]\nstrategy = "round_robin"\n[[instances]]\nurl = "http://127.0.0.1:9"\n')
    result = runner.invoke(app, ["check-config", "--config", str(cfg)], env={"TAOTOKEN_API_KEY": "x"})
    assert result.exit_code == 0, result.output
    data = tomllib.loads(result.stdout)
    assert data["dispatch"]["strategy"] == "round_robin"
    assert data["gateway"]["request_timeout"] == 120
    assert data["instances"][0]["url"] == "http://127.0.0.1:9"


def test_check_config_says_what_serve_would_refuse_outside_the_files(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[gateway]\nadmin_key_env = "ADMIN_KEY"\n[[instances]]\nurl = "http://127.0.0.1:9"\n'
        '[[keys]]\nname = "team-a"\nkey_env = "TEAM_A_KEY"\n'
    )
    result = runner.invoke(app, ["check-config", "--config", str(cfg)], env={"TAOTOKEN_API_KEY": "x"})
    assert result.exit_code == 0, result.output
    assert "key_env names TEAM_A_KEY, which is not set" in result.stderr
    assert "admin_key_env names ADMIN_KEY, which is not set" in result.stderr
    cfg.write_text('[gateway]\nadmin_key_env = ""\n')
    result = runner.invoke(app, ["check-config", "--config", str(cfg)])
    assert result.exit_code == 2 and "must name an environment variable" in result.output


def test_check_config_refuses_a_misspelled_strategy(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[dispatch]\nstrategy = "leastbusy"\n')
    result = runner.invoke(app, ["check-config", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "least_busy, round_robin" in result.output


def test_init_writes_loadable_files_and_does_not_overwrite(tmp_path: Path) -> None:
    result = runner.invoke(app, ["init", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "config.toml").exists() and (tmp_path / "settings.json").exists()
    result = runner.invoke(app, ["check-config", "--config", str(tmp_path / "config.toml")])
    assert result.exit_code == 0, result.output
    assert len(tomllib.loads(result.stdout)["instances"]) == 4  # from settings.json next to it
    assert runner.invoke(app, ["init", str(tmp_path)]).exit_code == 1


async def test_status_and_drain_against_a_running_gateway(gw: Running) -> None:
    args = ["--url", gw.url, "--key", KEY]
    result = await asyncio.to_thread(runner.invoke, app, ["status", *args, "--json"])
    assert result.exit_code == 0, result.output
    assert '"verdict": "ok"' in result.stdout
    result = await asyncio.to_thread(runner.invoke, app, ["status", *args])
    assert result.exit_code == 0 and "i0" in result.stdout and "i1" in result.stdout
    result = await asyncio.to_thread(runner.invoke, app, ["drain", "i0", *args])
    assert result.exit_code == 0, result.output
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as h:
        for _ in range(4):
            r = await h.post(
                gw.api_base + "/completions", json={"model": "emulated-model", "prompt": "x", "max_tokens": 1}
            )
            assert r.headers["x-taogate-instance"] == "i1"
    result = await asyncio.to_thread(runner.invoke, app, ["undrain", "i0", *args])
    assert result.exit_code == 0
    result = await asyncio.to_thread(runner.invoke, app, ["drain", "nope", *args])
    assert result.exit_code == 1 and "instance_not_found" in result.output


async def test_serve_runs_as_a_process_reloads_on_sighup_and_stops_on_sigterm(
    gw: Running, tmp_path: Path
) -> None:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    cfg = tmp_path / "config.toml"
    urls = gw.fleet.urls
    instances = f'[[instances]]\nurl = "{urls[0]}"\nname = "a"\n'
    cfg.write_text(f"[gateway]\nport = {port}\nmax_headers = 20\n{instances}")
    env = {**os.environ, "TAOTOKEN_API_KEY": KEY}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "taogate.cli",
        "serve",
        "--config",
        str(cfg),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=5) as h:
            for _ in range(150):
                try:
                    if (await h.get(base + "/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            rows = (await h.get(base + "/admin/instances")).json()["instances"]
            assert [r["name"] for r in rows] == ["a"]
            # served with the gateway's own protocol and the config's limits
            fields = "".join(f"x-{i}: v\r\n" for i in range(20))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /health HTTP/1.1\r\nhost: x\r\n{fields}\r\n".encode())
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 431 ") and b"too_many_headers" in answer
            body = {"model": "emulated-model", "prompt": "hi", "max_tokens": 1}
            r = await h.post(base + "/v1/completions", json=body, headers={"x-request-id": "cli-access-1"})
            assert r.status_code == 200
            cfg.write_text(cfg.read_text() + f'[[instances]]\nurl = "{urls[1]}"\nname = "b"\n')
            proc.send_signal(signal.SIGHUP)
            for _ in range(50):
                rows = (await h.get(base + "/admin/instances")).json()["instances"]
                if len(rows) == 2:
                    break
                await asyncio.sleep(0.1)
            assert [r["name"] for r in rows] == ["a", "b"]
            cfg.write_text(cfg.read_text().replace('name = "b"', 'name = "b"\nrole = "nonsense"'))
            r = await h.post(base + "/admin/reload")
            assert r.status_code == 400 and "role" in r.json()["error"]["message"]
            assert len((await h.get(base + "/admin/instances")).json()["instances"]) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (systemd counts that as clean).
    assert proc.returncode in (0, -signal.SIGTERM), err.decode()
    assert b"Application shutdown complete" in err
    assert b"reload refused, the running config stays" in err
    assert b"httpx" not in err  # probes are not logged one by one
    # The access line, batched in its own buffer, is flushed by the shutdown before the signal ends it.
    stamp = rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"  # LOG_FORMAT's, though written without a LogRecord
    assert re.search(stamp + rb" INFO taogate.access: request_id=cli-access-1 route=completions ", err)
