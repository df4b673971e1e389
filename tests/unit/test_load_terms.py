"""``LeastBusy._costs`` prices from each view's ``load_terms`` (the view's part, computed once per view
and load model) plus the request's part; it gives the floats ``load.estimate`` gives per candidate
(``_EstimateCosts``, the formulation it replaced, kept here as the reference), and so the same
decisions, however often a view is priced and under whichever load model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.load import DEFAULT_LOAD, LoadModel, estimate, horizon, view_terms
from taogate.dispatch.policy import LeastBusy
from taogate.dispatch.types import InstanceView, RequestFacts

from .test_dispatch_load import engines


class _EstimateCosts(LeastBusy):
    def _costs(
        self, req: RequestFacts, candidates: Sequence[InstanceView], work: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        costs: list[float] = []
        ttfts: list[float] = []
        for v, w in zip(candidates, work, strict=True):
            ttft, latency = estimate(v, w, req.max_tokens, self.load)
            ttfts.append(ttft)
            costs.append(latency)
        return costs, ttfts


views = st.builds(
    InstanceView,
    name=st.sampled_from("abcdef"),
    inflight=st.integers(-2, 64),
    decoding=st.integers(-2, 64),
    prefilling=st.none() | st.integers(-2, 64),
    prefill_tokens=st.integers(-10, 10**6),
    speed=st.floats(0, 1e6),
    base_latency=st.floats(-1, 5),
    decode_seconds_per_token=st.floats(-0.1, 0.5),
    uncached_ratio=st.floats(-1, 2),
    engine=engines,
    prefill_work=st.none() | st.integers(-10, 10**6),
)
models = st.builds(
    LoadModel,
    typical_prompt_tokens=st.floats(0, 4096),
    decode_horizon=st.integers(0, 64),
    decode_batch_ref=st.floats(-1, 0) | st.floats(1e-3, 128),
    kv_threshold=st.floats(0, 0.99),
    kv_penalty=st.floats(0, 4),
)
requests = st.builds(
    RequestFacts,
    model=st.none(),
    prompt_tokens=st.integers(-5, 10**6),
    long=st.just(False),
    max_tokens=st.none() | st.integers(-5, 10**4),
)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.python_only
@settings(max_examples=400, deadline=None)
@given(
    fleet=st.lists(views, min_size=1, max_size=5),
    rounds=st.lists(
        st.tuples(
            requests, st.sampled_from([0, 1, 2]), st.lists(st.floats(-10, 10**6), min_size=5, max_size=5)
        ),
        min_size=1,
        max_size=6,
    ),
    loads=st.lists(models, min_size=2, max_size=2),
)
def test_costs_from_kept_terms_are_the_estimate_per_candidate(
    fleet: list[InstanceView],
    rounds: list[tuple[RequestFacts, int, list[float]]],
    loads: list[LoadModel],
) -> None:
    new, old = LeastBusy(), _EstimateCosts()
    for req, which, work in rounds:
        new.load = old.load = [*loads, DEFAULT_LOAD][which]  # the load model may change between rounds
        priced = work[: len(fleet)]
        got, want = new._costs(req, fleet, priced), old._costs(req, fleet, priced)
        assert _same(got[0], want[0]) and _same(got[1], want[1])
        assert all(v.load_terms is not None and v.load_terms[0] is new.load for v in fleet)
        assert new.choose(req, fleet) == old.choose(req, fleet)
        assert new._last == old._last


@settings(max_examples=200, deadline=None)
@given(view=views, model=models, max_tokens=st.none() | st.integers(-5, 10**4))
def test_terms_are_of_the_view_alone_and_never_copied_to_another(
    view: InstanceView, model: LoadModel, max_tokens: int | None
) -> None:
    view.load_terms = view_terms(view, model)
    other = replace(view, inflight=view.inflight + 1)
    assert other.load_terms is None  # a changed copy is priced afresh
    assert other == replace(view, inflight=view.inflight + 1) and view == replace(view)
    assert horizon(max_tokens, model) <= model.decode_horizon
