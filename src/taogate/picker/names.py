"""The names under which the picker reads what the gateway in front tells it.

The Inference Extension names its request headers and Envoy metadata keys ``x-gateway-*``. llm-d's
router, built on it, renamed them (``x-llm-d-inference-objective``, later
``x-llm-d-router-inference-objective``, ...) and still reads the old names as aliases. The picker
reads each under all of them, the Inference Extension's first, so a route or a client set up for
either stack is understood. What the picker writes (the destination) keeps the Inference
Extension's name, which the shipped Envoy bootstrap reads.
"""

from __future__ import annotations

from taogate.picker.encoding import Headers
from taogate.proxy.auth import header

__all__ = ["FAIRNESS_ID", "MODEL_REWRITE", "OBJECTIVE", "SERVED", "SUBSET", "first_header"]

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
#: Keys of Envoy's dynamic metadata: the endpoints a pick must come from, the one that served.
SUBSET = ("x-gateway-destination-endpoint-subset", "x-llm-d-router-destination-endpoint-subset")
SERVED = ("x-gateway-destination-endpoint-served", "x-llm-d-router-destination-endpoint-served")


def first_header(headers: Headers, names: tuple[bytes, ...]) -> tuple[bytes, bytes] | None:
    """The first of ``names`` that ``headers`` carry, and its value; None when they carry none."""
    for name in names:
        value = header(headers, name)
        if value is not None:
            return name, value
    return None
