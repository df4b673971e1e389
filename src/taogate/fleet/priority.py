"""The order in which the gateway queue offers a freed slot to its waiters.

Lower priority values first, arrival order within a class; but at most ``oldest_every - 1`` grants
in a row may pass over the oldest waiter: the next one is offered to it first, whatever its class.
So the lowest class keeps at least one slot in ``oldest_every`` while it waits (a sustained flood of
urgent requests cannot starve it), and no waiter waits behind more than what was queued before it
plus the urgent ones that overtake it, ``oldest_every - 1`` at a time.

``FairOrder`` keeps one such order per client key and offers the keys' waiters by fair share
(``tenancy.fairshare``): the key with the fewest recent tokens first, priority classes within a key.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from taogate.tenancy.fairshare import FairShare

__all__ = ["FairOrder", "Queued", "WaitOrder"]


class Queued(Protocol):
    @property
    def key(self) -> tuple[int, int]: ...  # (priority, arrival number)

    @property
    def tenant(self) -> str: ...  # the client key's name


W = TypeVar("W", bound=Queued)


class WaitOrder(Generic[W]):
    """The waiters, sorted by (priority, arrival), and the count of grants that skipped the oldest."""

    __slots__ = ("_items", "_keys", "oldest_every", "passed_over")

    def __init__(self, oldest_every: int) -> None:
        self._items: list[W] = []
        self._keys: list[tuple[int, int]] = []
        self.oldest_every = oldest_every
        self.passed_over = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return any(w is item for w in self._items)

    def add(self, item: W) -> None:
        at = bisect.bisect(self._keys, item.key)
        self._keys.insert(at, item.key)
        self._items.insert(at, item)

    def remove(self, item: W) -> None:
        at = bisect.bisect_left(self._keys, item.key)
        if at < len(self._items) and self._items[at] is item:
            del self._items[at], self._keys[at]

    def pop_all(self) -> list[W]:
        items, self._items, self._keys = self._items, [], []
        return items

    def offers(self) -> Iterator[W]:
        """The waiters in the order a freed slot is offered to them (a snapshot)."""
        items = list(self._items)
        if items and self.passed_over >= self.oldest_every - 1:
            oldest = min(items, key=lambda w: w.key[1])
            yield oldest
            yield from (w for w in items if w is not oldest)
        else:
            yield from items

    def granted(self, item: W) -> None:
        """A slot went to ``item`` (still queued here): count whether it passed over the oldest."""
        oldest = min(w.key[1] for w in self._items)
        self.passed_over = 0 if item.key[1] == oldest else self.passed_over + 1
        self.remove(item)


class FairOrder(Generic[W]):
    """One ``WaitOrder`` per client key; a freed slot is offered to the keys by fair share."""

    __slots__ = ("_count", "_oldest_every", "_queues", "fair")

    def __init__(self, oldest_every: int, fair: FairShare) -> None:
        self._queues: dict[str, WaitOrder[W]] = {}
        self._oldest_every = oldest_every
        self._count = 0
        self.fair = fair

    @property
    def oldest_every(self) -> int:
        return self._oldest_every

    @oldest_every.setter
    def oldest_every(self, value: int) -> None:
        self._oldest_every = value
        for q in self._queues.values():
            q.oldest_every = value

    def __len__(self) -> int:
        return self._count

    def __contains__(self, item: object) -> bool:
        q = self._queues.get(getattr(item, "tenant", ""))
        return q is not None and item in q

    def add(self, item: W) -> None:
        q = self._queues.get(item.tenant)
        if q is None:
            self.fair.lift(item.tenant, self._queues)
            q = self._queues[item.tenant] = WaitOrder(self._oldest_every)
        q.add(item)
        self._count += 1

    def remove(self, item: W) -> None:
        q = self._queues.get(item.tenant)
        if q is None:
            return
        before = len(q)
        q.remove(item)
        self._count -= before - len(q)
        if not q:
            del self._queues[item.tenant]

    def pop_all(self) -> list[W]:
        items = [w for q in self._queues.values() for w in q.pop_all()]
        self._queues.clear()
        self._count = 0
        return items

    def offers(self) -> Iterator[W]:
        """Keys by their counters (fewest recent tokens first), each key's waiters in its order."""
        queues = self._queues
        if len(queues) == 1:
            yield from next(iter(queues.values())).offers()
            return
        counter = self.fair.counter
        for name in sorted(queues, key=counter):
            q = queues.get(name)
            if q is not None:
                yield from q.offers()

    def granted(self, item: W) -> None:
        q = self._queues[item.tenant]
        q.granted(item)
        self._count -= 1
        if not q:
            del self._queues[item.tenant]
