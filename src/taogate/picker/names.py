"""The names under which the picker reads what the gateway in front tells it, and writes its pick.

The Inference Extension names its request headers and Envoy metadata keys ``x-gateway-*``. llm-d's
router, built on it, renamed them (``x-llm-d-inference-objective``, later
``x-llm-d-router-inference-objective``, ...) and still reads the old names as aliases. The picker
reads each under all of them, the Inference Extension's first, so a route or a client set up for
either stack is understood. It writes its pick under both names of the destination, so an Envoy
set up for either routes by it, and a client cannot steer a request by sending the name the
picker would have left alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from taogate.proxy.auth import header

__all__ = ["DESTINATION", "FAIRNESS_ID", "MODEL_REWRITE", "OBJECTIVE", "SERVED", "SUBSET", "first_header"]

OBJECTIVE = (
    b"x-gateway-inference-objective",
    b"x-llm-d-router-inference-objective",
    b"x-llm-d-inference-objective",
)
FAIRNESS_ID = (
    b"x-gateway-inference-fairness-id",
    b"x-llm-d-router-inference-fairness-id",
    b"x-llm-d-inference-fairness-id",
)
MODEL_REWRITE = (
    b"x-gateway-model-name-rewrite",
    b"x-llm-d-router-model-name-rewrite",
    b"x-llm-d-model-name-rewrite",
)
#: Where the pick goes: a request header and a key of Envoy's ``envoy.lb`` metadata, under each name.
DESTINATION = ("x-gateway-destination-endpoint", "x-llm-d-router-destination-endpoint")
#: Keys of Envoy's dynamic metadata: the endpoints a pick must come from, the one that served.
SUBSET = ("x-gateway-destination-endpoint-subset", "x-llm-d-router-destination-endpoint-subset")
SERVED = ("x-gateway-destination-endpoint-served", "x-llm-d-router-destination-endpoint-served")


def first_header(
    headers: Iterable[tuple[bytes, bytes]], names: tuple[bytes, ...]
) -> tuple[bytes, bytes] | None:
    """The first of ``names`` that ``headers`` carry, and its value; None when they carry none."""
    for name in names:
        value = header(headers, name)
        if value is not None:
            return name, value
    return None
