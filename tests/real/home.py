"""``.real-vllm/``: what the real tier keeps between runs, and making it ready (venv, then models).

Layout under the repo root (gitignored): ``venv/`` (unless ``$TAOGATE_REAL_VLLM_VENV`` points
elsewhere), ``models/<name>-<hash>/``, ``logs/`` (install log, one log per server), ``.lock``.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.real.models import FAST, SLOW, BuiltModels, ModelSpec, ensure_models
from tests.real.venv import ensure_venv, venv_dir

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / ".real-vllm"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Prepared:
    """A vLLM venv ready to serve, the models built, and how long each step took (seconds)."""

    python: Path
    models: BuiltModels
    logs: Path
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def _locked(path: Path, log: Log) -> Iterator[None]:
    """Another test run of this checkout may be installing right now: wait for it, do not race it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another run holding {path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare(log: Log, specs: Sequence[ModelSpec] = (FAST, SLOW), home: Path = HOME) -> Prepared:
    """Make the venv and the models ready; instant when both were made by an earlier run."""
    logs = home / "logs"
    timings: dict[str, float] = {}
    with _locked(home / ".lock", log):
        started = time.monotonic()
        python = ensure_venv(venv_dir(home), install_log=logs / "install.log", log=log)
        timings["venv"] = time.monotonic() - started
        started = time.monotonic()
        models = ensure_models(python, home / "models", specs, log=log)
        timings["models"] = time.monotonic() - started
    return Prepared(python, models, logs, timings)
