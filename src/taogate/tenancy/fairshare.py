"""Fair share under contention: a virtual token counter per key, as in VTC (Sheng et al., OSDI 2024).

Each key's counter grows by the tokens served to it, divided by its weight; when the gateway queue
holds requests of several keys, the key with the smallest counter goes first. A key that starts
waiting is first lifted to the smallest counter among the keys already waiting (to the largest of
all when none waits), so idle time banks no credit: only recent service counts. Between two keys
that both keep waiting, the weighted service differs by at most one request's tokens.

Behind a gateway that authenticates (picker mode without the key check), the flows it names take
the keys' place; they are not in the config, so at most ``MAX_FLOWS`` counters are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["MAX_FLOWS", "FairShare"]

#: Counters kept for names outside the key table. Past it, the half that were served least go:
#: one of them would be lifted to the waiting keys' least when it next waits anyway.
MAX_FLOWS = 4096


class FairShare:
    """The counters; ``weights`` from the key table (a name not in it, a flow, weighs 1)."""

    __slots__ = ("_served", "weights")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._served: dict[str, float] = {}
        self.weights: dict[str, float] = dict(weights or {})

    def configure(self, weights: Mapping[str, float]) -> None:
        """A reloaded key table: new weights; counters of keys that went are dropped."""
        gone = [n for n in self.weights if n not in weights]
        self.weights = dict(weights)
        for name in gone:
            self._served.pop(name, None)

    def counter(self, key: str) -> float:
        return self._served.get(key, 0.0)

    def charge(self, key: str, tokens: float) -> None:
        """Tokens served to ``key`` (a correction may be negative)."""
        served = self._served
        if key not in served and len(served) >= MAX_FLOWS + len(self.weights):
            self._forget_least()
        served[key] = served.get(key, 0.0) + tokens / self.weights.get(key, 1.0)

    def _forget_least(self) -> None:
        """The half of the flows (names outside the key table) that were served least go."""
        flows = sorted((v, n) for n, v in self._served.items() if n not in self.weights)
        for _, name in flows[: len(flows) // 2 + 1]:
            del self._served[name]

    def lift(self, key: str, waiting: Iterable[str]) -> None:
        """``key`` starts waiting beside the keys ``waiting``: no credit from its idle time."""
        others = [self._served.get(k, 0.0) for k in waiting if k != key]
        floor = min(others) if others else max(self._served.values(), default=0.0)
        if self._served.get(key, 0.0) < floor:
            self._served[key] = floor
