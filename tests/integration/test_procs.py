"""``bench.procs.launch``: a niced child yields the CPU to its caller, its own children included."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from taogate.bench.procs import launch

# The child starts a grandchild (as vLLM starts its engine), then says it is ready.
_CHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
    "print('ready at', g.pid, flush=True)\n"
    "time.sleep(30)\n"
)


def _session_nice(pid: int) -> str | None:
    """The nice value of the process's session, where the kernel schedules sessions as groups."""
    group = Path(f"/proc/{pid}/autogroup")  # "/autogroup-<n> nice <v>"
    return group.read_text().split()[-1] if group.exists() else None


async def test_a_niced_child_and_its_children_run_below_the_caller() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    async with launch([sys.executable, "-c", _CHILD], ready_prefix="ready at", niceness=5) as child:
        grandchild = int(child.urls[0])
        for pid in (child.proc.pid, grandchild):
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 5)
        assert _session_nice(child.proc.pid) in (None, "5")
    assert child.proc.returncode is not None
