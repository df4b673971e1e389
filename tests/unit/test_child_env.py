"""A benchmark's child runs in its own directory, yet imports what the caller's PYTHONPATH meant."""

from __future__ import annotations

import os
from pathlib import Path

from taogate.bench.procs import child_env


def test_relative_entries_become_absolute_when_the_child_runs_elsewhere(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join(["build/site", "/abs/lib"]), "X": "1"}
    out = child_env(env, tmp_path)
    assert out is not None
    assert out["PYTHONPATH"].split(os.pathsep) == [str(Path("build/site").absolute()), "/abs/lib"]
    assert out["X"] == "1"
    assert env["PYTHONPATH"].startswith("build/site")  # the caller's mapping is not changed


def test_the_environment_is_left_alone_in_our_own_directory() -> None:
    assert child_env(None, None) is None
    assert child_env({"PYTHONPATH": "rel"}, None) == {"PYTHONPATH": "rel"}


def test_an_inherited_environment_is_copied_when_the_directory_changes(tmp_path: Path) -> None:
    out = child_env(None, tmp_path)
    assert out is not None and out.get("PATH") == os.environ.get("PATH")
