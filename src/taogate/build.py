"""Which build of taogate runs: the request path compiled by mypyc (``make compiled``), or Python.

The two serve the same requests; the compiled one costs about half the instructions a
request (benchmarks/README.md). ``taogate serve`` logs which one it is at start, and /metrics says
it as ``taogate_build_info``, so a CPU figure can be read against the build that made it.
"""

from __future__ import annotations

import importlib.util
from typing import Final, Literal

__all__ = ["BUILD", "build_of"]


def build_of(module: str = "taogate.listener") -> Literal["compiled", "python"]:
    """``compiled`` when ``module`` (one the wheel hook compiles) is an extension module."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    return "compiled" if origin is not None and origin.endswith(".so") else "python"


BUILD: Final = build_of()
