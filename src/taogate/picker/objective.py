"""A request's InferenceObjective, as the Inference Extension names it, turned into its priority class.

The gateway in front (or the client) names the objective in ``x-gateway-inference-objective`` (or
llm-d's name for it, ``picker.names``); ``[picker] objectives`` gives each name the priority of its
InferenceObjective, where a higher priority is served first. taogate's class is vLLM's, where a
lower value goes first, so an objective of priority p is the class -p. It stands in for the
request's own claim (``X-Priority``, the body's ``priority``), and the key's ``max_priority``
ceiling still applies to it. As in the Inference Extension, an objective of negative priority is
sheddable: refused at once where it would wait.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from taogate.picker.encoding import Headers
from taogate.picker.names import OBJECTIVE, first_header
from taogate.proxy.priority import HEADER

__all__ = ["Objectives", "objective_class"]

#: Unknown names said once each, up to this many (a client could send endless names).
_SAY_AT_MOST = 64

log = logging.getLogger("taogate.picker")


def objective_class(name: bytes | None, objectives: Mapping[str, int]) -> int | None:
    """The priority class of the objective ``name``; None when no objective is named or the name
    is not configured."""
    if name is None or not objectives:
        return None
    priority = objectives.get(name.decode("latin-1"))
    return None if priority is None else -priority


class Objectives:
    """Reads the objective of each request; says once per name when one is not configured."""

    def __init__(self) -> None:
        self._unknown: set[bytes] = set()

    def read(self, headers: Headers, objectives: Mapping[str, int]) -> tuple[Headers, bool]:
        """(``headers`` with the class of the objective they name as ``X-Priority``, in place of
        any the client sent, or as they are when they name none that is configured; whether the
        objective is sheddable)."""
        found = first_header(headers, OBJECTIVE)
        name = None if found is None else found[1]
        priority = objective_class(name, objectives)
        if priority is None:
            said = None if name is None else name[:253]  # an object name's length at most
            if said is not None and said not in self._unknown and len(self._unknown) < _SAY_AT_MOST:
                self._unknown.add(said)
                log.warning(
                    "objective %r is not in [picker] objectives: its requests keep the priority "
                    "they claim themselves (default 0)",
                    said.decode("latin-1"),
                )
            return headers, False
        return [*(h for h in headers if h[0] != HEADER), (HEADER, str(priority).encode())], priority > 0
