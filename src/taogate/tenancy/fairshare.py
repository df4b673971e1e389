"""Fair share under contention: a virtual token counter per key, as in VTC (Sheng et al., OSDI 2024).

Each key's counter grows by the tokens served to it, divided by its weight; when the gateway queue
holds requests of several keys, the key with the smallest counter goes first. A key that starts
waiting is first lifted to the smallest counter among the keys already waiting (to the largest of
all when none waits), so idle time banks no credit: only recent service counts. Between two keys
that both keep waiting, the weighted service differs by at most one request's tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["FairShare"]


class FairShare:
    """The counters; ``weights`` from the key table (a key not in it weighs 1)."""

    __slots__ = ("_served", "weights")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._served: dict[str, float] = {}
        self.weights: dict[str, float] = dict(weights or {})

    def configure(self, weights: Mapping[str, float]) -> None:
        """A reloaded key table: new weights; counters of keys that went are dropped."""
        self.weights = dict(weights)
        for name in [n for n in self._served if n not in self.weights]:
            del self._served[name]

    def counter(self, key: str) -> float:
        return self._served.get(key, 0.0)

    def charge(self, key: str, tokens: float) -> None:
        """Tokens served to ``key`` (a correction may be negative)."""
        self._served[key] = self._served.get(key, 0.0) + tokens / self.weights.get(key, 1.0)

    def lift(self, key: str, waiting: Iterable[str]) -> None:
        """``key`` starts waiting beside the keys ``waiting``: no credit from its idle time."""
        others = [self._served.get(k, 0.0) for k in waiting if k != key]
        floor = min(others) if others else max(self._served.values(), default=0.0)
        if self._served.get(key, 0.0) < floor:
            self._served[key] = floor
