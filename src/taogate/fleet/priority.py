"""The order in which the gateway queue offers a freed slot to its waiters.

Lower priority values first, arrival order within a class; but at most ``oldest_every - 1`` grants
in a row may pass over the oldest waiter: the next one is offered to it first, whatever its class.
So the lowest class keeps at least one slot in ``oldest_every`` while it waits (a sustained flood of
urgent requests cannot starve it), and no waiter waits behind more than what was queued before it
plus the urgent ones that overtake it, ``oldest_every - 1`` at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Queued", "WaitOrder"]


class Queued(Protocol):
    @property
    def key(self) -> tuple[int, int]: ...  # (priority, arrival number)


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
