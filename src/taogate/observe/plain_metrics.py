"""Counters and histograms kept in plain numbers, turned into Prometheus samples at scrape time.

prometheus_client's children take a lock per update (a histogram two, after a loop over its
buckets in Python). The gateway updates its metrics from its event loop only, so a label set's
child here is a float (a counter) or a list of bucket counts found by bisection (a histogram), and
the family is a collector that writes the same samples prometheus_client's ``Counter`` and
``Histogram`` would (``_total`` and ``_created``; ``_bucket``, ``_count``, ``_sum`` and
``_created``). The surface is theirs too: ``labels(...)``, ``inc``, ``observe``, ``remove``.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import INF, floatToGoString

__all__ = ["PlainCounter", "PlainHistogram"]


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Counted in the first bucket whose upper bound is at least ``amount`` (``le``)."""
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


C = TypeVar("C", CounterChild, HistogramChild)


@mypyc_attr(native_class=False)
class _Family(Collector, Generic[C]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        if not self._labelnames:
            self._children[()] = self._new()
        registry.register(self)

    @abstractmethod
    def _new(self) -> C:
        """A fresh child for one label set."""

    def labels(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes the labels {self._labelnames}, not {values}")
            child = self._children[values] = self._new()
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    @abstractmethod
    def _family(self) -> Metric:
        """An empty family of this metric's type, to fill with samples."""


@mypyc_attr(native_class=False)
class PlainCounter(_Family[CounterChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry,
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self._children[()].inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


@mypyc_attr(native_class=False)
class PlainHistogram(_Family[HistogramChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if bounds[-1] != INF:
            bounds.append(INF)
        self._bounds = tuple(bounds)
        self._les: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        """For a histogram without labels."""
        self._children[()].observe(amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for le, count in zip(self._les, child.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, child.sum)
            labels = dict(zip(self._labelnames, values, strict=True))
            family.samples.append(Sample(self._name + "_created", labels, child.created))
        yield family
