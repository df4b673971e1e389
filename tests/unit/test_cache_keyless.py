"""The cache model's flat pass for requests without a prefix key leaves the same state as the
general one did: the same entries in the same LRU order, the same blocks used, the same tickets."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.cache_model import PrefixCacheModel, Ticket, _Entry


def _general_dispatch(m: PrefixCacheModel, prompt: int, out: int) -> Ticket:
    """``dispatched(None, 0, prompt, out)`` as the general path computed it."""
    rest = m._blocks(max(0, prompt) + max(0, out))
    anon = -next(m._anon)
    if rest:
        m._insert(anon, _Entry(rest, False, pinned=1, uses=1))
    m._evict()
    return Ticket(None, anon, 0, 0)


def _general_finish(m: PrefixCacheModel, ticket: Ticket) -> None:
    entry = m._entries.get(ticket.anon)
    if entry is not None:
        entry.pinned = max(0, entry.pinned - 1)
        m._entries.move_to_end(ticket.anon)
    m._evict()


def _state(m: PrefixCacheModel) -> tuple[object, ...]:
    entries = [(k, dataclasses.astuple(e)) for k, e in m._entries.items()]
    return (entries, m.used, m._predicted, m.trust)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["keyless", "keyless", "keyed", "finish", "first"]),
        st.integers(0, 3),  # a prefix key
        st.integers(-5, 400),  # prompt tokens
        st.integers(0, 200),  # output tokens
        st.integers(0, 50),  # which ticket
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 40), block=st.sampled_from([1, 16]))
def test_keyless_dispatch_and_finish_leave_the_state_the_general_path_left(
    ops: list[tuple[str, int, int, int, int]], capacity: int, block: int
) -> None:
    flat, general = PrefixCacheModel(capacity, block), PrefixCacheModel(capacity, block)
    tickets: list[tuple[Ticket, Ticket]] = []
    for op, key, prompt, out, which in ops:
        if op == "keyless":
            pair = (flat.dispatched(None, 0, prompt, out), _general_dispatch(general, prompt, out))
            assert pair[0] == pair[1]
            tickets.append(pair)
        elif op == "keyed":
            pair = (flat.dispatched(key, 64, prompt, out), general.dispatched(key, 64, prompt, out))
            assert pair[0] == pair[1]
            tickets.append(pair)
        elif tickets:
            a, b = tickets.pop(which % len(tickets)) if op == "finish" else tickets[which % len(tickets)]
            if op == "first":
                flat.computed(a)
                general.computed(b)
            elif a.key is None:
                flat.finished(a)
                _general_finish(general, b)
            else:
                flat.finished(a)
                general.finished(b)
        assert _state(flat) == _state(general)
