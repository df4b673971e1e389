"""``LeastBusy._pick`` finds the near-ties and the fewest in flight among them in one pass; it picks
as the filters it replaced did (``_FilterPick``, kept here as the reference), rotation included
(``_rotate``, one pass, names as ``_next_after`` over the sorted names)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.affinity import rendezvous
from taogate.dispatch.policy import LeastBusy, _next_after, _rotate
from taogate.dispatch.types import InstanceView


class _FilterPick(LeastBusy):
    def _pick(
        self,
        candidates: Sequence[InstanceView],
        costs: Sequence[float],
        ttfts: Sequence[float],
        key: int | None = None,
    ) -> int:
        best = min(costs)
        i = costs.index(best)
        widen = 1.0 + self.tie_ratio
        cost_limit, ttft_limit = best * widen, ttfts[i] * widen
        pairs = enumerate(zip(costs, ttfts, strict=True))
        tied = [j for j, (c, t) in pairs if c <= cost_limit and t <= ttft_limit]
        if len(tied) > 1:
            fewest = min(candidates[j].inflight for j in tied)
            names = [candidates[j].name for j in tied if candidates[j].inflight == fewest]
            if len(names) == 1:
                name = names[0]
            elif key is not None:
                name = rendezvous(key, names) or names[0]
            else:
                name = _next_after(names, self._last)
            i = next(j for j in tied if candidates[j].name == name)
        self._last = candidates[i].name
        return i


ROUNDS = st.lists(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # in flight
            st.sampled_from([1.0, 1.02, 1.04, 1.05, 1.06, 2.0]),  # cost
            st.sampled_from([0.5, 0.51, 0.53, 0.6]),  # expected TTFT
        ),
        min_size=1,
        max_size=6,
    ),
    min_size=1,
    max_size=12,
)


@pytest.mark.python_only
@settings(max_examples=400, deadline=None)
@given(rounds=ROUNDS, keys=st.lists(st.none() | st.integers(0, 2**64 - 1), min_size=12, max_size=12))
def test_one_pass_picks_as_the_filters(
    rounds: list[list[tuple[int, float, float]]], keys: list[int | None]
) -> None:
    one, filters = LeastBusy(), _FilterPick()
    for row, key in zip(rounds, keys, strict=False):
        views = [InstanceView(f"i{j}", inflight=n) for j, (n, _, _) in enumerate(row)]
        costs = [c for _, c, _ in row]
        ttfts = [t for _, _, t in row]
        assert one._pick(views, costs, ttfts, key) == filters._pick(views, costs, ttfts, key)
        assert one._last == filters._last


@settings(max_examples=400, deadline=None)
@given(
    names=st.lists(st.sampled_from(["a", "b", "b2", "c", "i10", "i2"]), min_size=1, max_size=6),
    picks=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    last=st.none() | st.sampled_from(["", "a", "b", "b1", "c", "i1", "i10", "z"]),
)
def test_rotation_in_one_pass_names_as_the_sorted_names(
    names: list[str], picks: list[int], last: str | None
) -> None:
    views = [InstanceView(n) for n in names]
    at = sorted({p % len(names) for p in picks})
    at_names = [names[j] for j in at]
    want = at[at_names.index(_next_after(at_names, last))]  # the first of equal names, as _pick took it
    assert _rotate(views, at, last) == want
