"""The ``taogate`` command as a new user meets it, through its installed entry point: the version,
help that keeps every word, shipped files that do not warn about themselves, and bench/diagnose
reading the files ``serve`` reads, calling each instance what every other command calls it."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from typer.testing import CliRunner

from taogate import __version__
from taogate.app import serve_gateway
from taogate.cli import app, reflowed
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.instance_settings import instance_label
from taogate.settings import Settings
from tests.conftest import KEY

TAOGATE = Path(sys.executable).with_name("taogate")
ROOT = Path(__file__).resolve().parents[2]
QUICK = EmulatorConfig(prefill_tokens_per_s=200_000, step_overhead=0.002, decode_tokens_per_s=50_000)
LONG = ("gpu-a.inference.eu-west-1.example.internal", "gpu-b.inference.eu-west-1.example.internal")


def taogate(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "250", "NO_PROXY": "127.0.0.1", "TAOTOKEN_API_KEY": KEY}
    return subprocess.run(
        [str(TAOGATE), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
    )


def test_version_at_top_level() -> None:
    done = taogate("--version")
    assert (done.returncode, done.stdout.strip()) == (0, __version__), done.stderr


def _commands() -> Iterator[tuple[str, Any]]:
    commands: dict[str, Any] = getattr(typer.main.get_command(app), "commands")  # noqa: B009 (typer's own click)
    yield from commands.items()


def test_help_keeps_every_bracketed_word() -> None:
    """Help text goes through rich markup: "[gateway]" would vanish unless it is escaped. Rendered by
    the command's own app object (a process per command would cost seconds each)."""
    checked = 0
    for name, command in _commands():
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        words = {w for t in texts for w in re.findall(r"\[\[?[a-z_.]+\]\]?", t.replace("\\[", "["))}
        if not words:
            continue
        rendered = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "250"}).output
        for word in words:
            assert word in rendered, f"taogate {name} --help lost {word!r}"
            checked += 1
    assert checked >= 5  # [gateway] host and port, [dispatch] ..., [[instances]]


def test_help_paragraphs_flow_to_the_terminal_width() -> None:
    """typer keeps the source's line breaks past a command's first paragraph; at 80 columns they
    made ragged lines. Every command's paragraphs are reflowed; list items keep their own lines."""
    assert reflowed("First line\n  of it.\n\nSecond one\n--a-flag wraps here.\n- an item\n- another") == (
        "First line\n  of it.\n\nSecond one --a-flag wraps here.\n- an item\n- another"
    )
    for name, _command in _commands():
        rendered = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80"}).output
        prose = rendered.split("Usage:", 1)[1].split("╭", 1)[0].splitlines()[2:]
        lines = [line.rstrip() for line in prose]
        for this, after in itertools.pairwise(lines):  # a short line followed by more of its paragraph
            ragged = this and after and len(this) < 50 and not after.lstrip().startswith(("- ", "* "))
            assert not ragged, f"taogate {name} --help at 80 columns:\n" + "\n".join(lines)


def test_serve_help_lists_every_strategy_and_diagnose_says_whose_gateway() -> None:
    from taogate.dispatch.types import STRATEGIES

    serve = " ".join(taogate("serve", "--help").stdout.split())
    assert all(s in serve for s in STRATEGIES), serve
    diagnose = " ".join(taogate("diagnose", "--help").stdout.split())
    assert "gateway of its own" in diagnose and "--lowered-cap" in diagnose and "--configured-cap" in diagnose


def test_the_shipped_config_and_inits_do_not_warn_about_themselves(tmp_path: Path) -> None:
    template = ROOT / "src" / "taogate" / "templates" / "config.toml"
    assert (ROOT / "config.toml").read_text() == template.read_text()
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in ("config.toml", "settings.json"):
        shutil.copy(ROOT / name, shipped / name)
    assert taogate("init", str(tmp_path / "init")).returncode == 0
    for where in (shipped, tmp_path / "init"):
        done = taogate("check-config", cwd=where)
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stderr, done.stderr


@asynccontextmanager
async def fleet_and_gateway(n: int = 2) -> AsyncIterator[tuple[list[str], str]]:
    """Emulated instances and a gateway in front of them whose instances have no configured name."""
    configs = [replace(QUICK, seed=i) for i in range(n)]
    async with run_fleet(configs) as fleet:
        settings = Settings(
            gateway={"base_url": "http://127.0.0.1:8080/api", "request_timeout": 30},
            dispatch={"health_check_interval": 0.5, "scrape_interval": 0.2, "warmup_tokens": 0},
            instances=[{"url": u} for u in fleet.urls],
        )
        async with serve_gateway(settings, key=KEY) as gw:
            yield list(fleet.urls), gw.url


def _profile(where: Path, urls: list[str], base_url: str = "http://127.0.0.1:9/api") -> None:
    where.mkdir(exist_ok=True)
    profile = {
        "taotoken": {"base_url": base_url, "api_key": "${TAOTOKEN_API_KEY}", "default_model": QUICK.model},
        "vllm": {"instances": urls},
    }
    (where / "settings.json").write_text(json.dumps(profile))


def _per_instance(report: dict[str, Any]) -> set[str]:
    return {name for run in report["runs"] for name in run["summary"]["per_instance"]}


SMALL = ["--requests", "4", "--concurrency", "2", "--prompt-tokens", "300", "--max-tokens", "2"]


async def test_compare_reads_settings_json_here_and_names_instances_as_the_gateway_does(
    tmp_path: Path,
) -> None:
    async with fleet_and_gateway() as (urls, gateway):
        _profile(tmp_path, urls, gateway + "/api")
        out = tmp_path / "compare.json"
        done = await asyncio.to_thread(
            taogate, "bench", "--compare", *SMALL, "--json", str(out), cwd=tmp_path, timeout=180
        )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["runs"][0]["label"].startswith("your gateway")  # ./settings.json's base_url
    assert all(r["summary"]["ok"] == 4 for r in report["runs"]), done.stdout
    # The user's gateway and every compare row call the instances alike: one column each.
    assert _per_instance(report) == {instance_label(u) for u in urls}


async def test_diagnose_reads_config_toml_here_its_names_and_its_cap(tmp_path: Path) -> None:
    async with fleet_and_gateway() as (urls, _):
        instances = "".join(
            f'[[instances]]\nurl = "{u}"\nname = "{n}"\n' for u, n in zip(urls, LONG, strict=True)
        )
        (tmp_path / "config.toml").write_text("[dispatch]\nmax_queue_per_instance = 12\n\n" + instances)
        _profile(tmp_path, ["http://127.0.0.1:9"])  # config.toml's instances win, as in serve
        out = tmp_path / "diagnose.json"
        done = await asyncio.to_thread(
            taogate, "diagnose", *SMALL, "--model", QUICK.model, "--json", str(out), cwd=tmp_path, timeout=180
        )
    assert done.returncode in (0, 2), done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert _per_instance(report) == set(LONG)
    assert all(name in done.stdout for name in LONG)
    # Run A at config.toml's cap, as serve would run.
    assert report["verdict"]["evidence"][0].startswith("cap 12"), report["verdict"]
    # The gateways' own log lines wait for the verdict, once each, instead of preceding the tables.
    assert "longer than the" not in done.stderr and "is slow" not in done.stderr, done.stderr


def test_diagnose_without_instances_says_where_it_looked(tmp_path: Path) -> None:
    done = taogate("diagnose", "--requests", "1", cwd=tmp_path)
    assert done.returncode == 3
    assert "[[instances]]" in done.stderr and "--instance" in done.stderr


def test_the_old_cap_flag_names_still_work(tmp_path: Path) -> None:
    done = taogate("diagnose", "--cap", "4", "--queue-cap", "16", "--requests", "1", cwd=tmp_path)
    assert done.returncode == 3 and "No such option" not in done.stderr, done.stderr


def test_prefix_caching_is_on_by_default_wherever_a_fleet_is_emulated() -> None:
    """bench, diagnose and emulate agree with each other and with the README's advice for vLLM."""
    import inspect

    from taogate.bench.cli import bench, diagnose
    from taogate.emulator.cli import emulate

    defaults = [
        inspect.signature(bench).parameters["prefix_caching"].default,
        inspect.signature(diagnose).parameters["prefix_caching"].default,
        inspect.signature(emulate).parameters["enable_prefix_caching"].default,
    ]
    assert defaults == [True, True, True]
    assert "--enable-prefix-caching" in (ROOT / "README.md").read_text()


def test_the_readme_worked_example_is_a_valid_config_without_warnings(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Point it at your vLLM fleet", 1)[1].split("\n## ", 1)[0]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "config.toml").write_text(example)
    done = taogate("check-config", cwd=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    assert [i["name"] for i in tomllib.loads(done.stdout)["instances"]] == ["gpu-a", "gpu-b"]


async def test_diagnose_names_a_slow_instance_by_host_port_as_the_gateway_would(tmp_path: Path) -> None:
    """The real tier's check, on emulated instances: --instance URLs, no config, an 8x slow second
    (engines slow enough that a probe's prefill, not the HTTP path, sets its speed)."""
    base = EmulatorConfig(prefill_tokens_per_s=80_000, step_overhead=0.003, decode_tokens_per_s=12_800)
    configs = [replace(base, seed=0), replace(base, seed=1, slowdown=8.0)]
    async with run_fleet(configs) as fleet:
        flags = [arg for url in fleet.urls for arg in ("--instance", url)]
        out = tmp_path / "diagnose.json"
        args = ("diagnose", *flags, *SMALL, "--prompt-tokens", "4000", "--model", base.model)
        done = await asyncio.to_thread(taogate, *args, "--json", str(out), cwd=tmp_path, timeout=180)
        slow = instance_label(fleet.urls[1])
    verdict = json.loads(out.read_text())["verdict"]
    assert (done.returncode, verdict["kind"], verdict["instance"]) == (2, "slow", slow), done.stdout


def test_counts_and_rates_of_zero_are_refused_by_name_not_by_a_traceback() -> None:
    cases = [
        ["bench", "--emulate", "--instances", "0", "--workload", "single"],
        ["diagnose", "--emulate", "--instances", "0"],
        ["bench", "--emulate", "--concurrency", "0"],
        ["diagnose", "--emulate", "--lowered-cap", "0"],
        ["diagnose", "--emulate", "--configured-cap", "0"],
        ["bench", "--emulate", "--workload", "mixed", "--rate", "0"],
    ]
    for args in cases:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 2 and "Invalid value for" in result.output, (args, result.output)
