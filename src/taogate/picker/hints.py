"""What the gateway in front tells the picker in metadata: a subset to pick from, and the endpoint
that really served a request; and the instances those ``ip:port`` endpoints name.

A subset may come as a list of ``ip:port`` strings (the protocol's form) or as one comma-separated
string (what a header-to-metadata filter produces); both are read, under the Inference Extension's
key or llm-d's (``picker.names``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from taogate.fleet.instance import Instance
from taogate.h1.origin import Origin
from taogate.picker.names import SERVED, SUBSET

__all__ = [
    "SERVED_NAMESPACE",
    "SUBSET_NAMESPACE",
    "excluded_by_subset",
    "instance_at",
    "served_endpoint",
    "subset_hint",
]

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVED_NAMESPACE = "envoy.lb"


def _field(metadata: Any, namespace: str, keys: tuple[str, ...]) -> Any | None:
    """``metadata_context.filter_metadata[namespace][key]`` as a protobuf Value, under the first of
    ``keys`` present, or None."""
    if metadata is None or namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    return next((fields[key] for key in keys if key in fields), None)


def _strings(value: Any) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [p.strip() for p in value.string_value.split(",") if p.strip()]
    if kind == "list_value":
        return [s for v in value.list_value.values for s in _strings(v)]
    return []


def subset_hint(metadata: Any) -> frozenset[str] | None:
    """The endpoints the pick must come from, or None when the gateway set no subset (an empty
    set when it set an empty one: then nothing may be picked)."""
    value = _field(metadata, SUBSET_NAMESPACE, SUBSET)
    return None if value is None else frozenset(_strings(value))


def served_endpoint(metadata: Any) -> str | None:
    """The endpoint that served the request, when the gateway reports it."""
    value = _field(metadata, SERVED_NAMESPACE, SERVED)
    if value is None:
        return None
    found = _strings(value)
    return found[0] if found else None


def excluded_by_subset(instances: Iterable[Instance], subset: frozenset[str]) -> frozenset[str]:
    """The instances outside the subset: the dispatcher's ``exclude`` for this request."""
    return frozenset(i.name for i in instances if endpoint_of(i.spec.url) not in subset)


def instance_at(instances: Iterable[Instance], endpoint: str) -> Instance | None:
    """The instance whose address is ``endpoint`` (``ip:port``)."""
    return next((i for i in instances if endpoint_of(i.spec.url) == endpoint), None)


@functools.lru_cache(maxsize=4096)
def origin_of(url: str) -> Origin:
    """An instance's URL parsed once: where it lives, and its Basic credentials if any."""
    return Origin.parse(url)


def endpoint_of(url: str) -> str:
    """An instance's ``host:port`` as the gateway in front routes to it (``ip:port`` where its URL
    names an IP): the scheme's default port if the URL gives none, never the URL's credentials."""
    return origin_of(url).endpoint
