"""Imported at the start of every vLLM process the real tier runs (``server.py`` puts this folder
on their ``PYTHONPATH``): ask Linux for the AMX tile state before any kernel uses it.

On a CPU with AMX, vLLM's CPU attention picks its AMX kernel for bf16, but Linux lets a process run
AMX instructions only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. vLLM leaves
that to oneDNN, which asks only when one of its own AMX matmuls runs first: the slow card's wider
layers get there, the fast card's narrow ones do not, and its worker dies of SIGILL at the first
request. Elsewhere the call fails harmlessly (no AMX, or not x86-64 Linux).
"""

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
