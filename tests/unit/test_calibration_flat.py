"""The token estimate's flat arithmetic (sums of written-out products) learns and predicts the same,
float for float, as the loops over the features it replaced (``_LoopFit``, kept here as the reference)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch import calibration
from taogate.dispatch.calibration import (
    _ABS_NOISE,
    _CLAMP_SIGMAS,
    _FORGET,
    _LOWER,
    _N,
    _REL_NOISE,
    _UPPER,
    TokenEstimator,
    _features,
    _Fit,
)
from taogate.dispatch.tokens import PromptSize


class _LoopFit(_Fit):
    """``_Fit`` as it was written, with a generator per sum."""

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(wi * xi for wi, xi in zip(self.w, x, strict=True))

    def update(self, x: tuple[float, ...], y: float) -> None:
        p = self.p
        px = [sum(p[i][j] * x[j] for j in range(_N)) for i in range(_N)]
        xpx = sum(x[i] * px[i] for i in range(_N))
        pred = self.predict(x)
        noise = (_REL_NOISE * max(y, pred, 1.0)) ** 2 + _ABS_NOISE**2
        s = xpx + noise
        if not (s > 0.0 and math.isfinite(s)):
            return
        residual = y - pred
        bound = _CLAMP_SIGMAS * math.sqrt(s)
        residual = max(-bound, min(bound, residual))
        gain = [v / s for v in px]
        for i in range(_N):
            self.w[i] = min(_UPPER[i], max(_LOWER[i], self.w[i] + gain[i] * residual))
        for i in range(_N):
            for j in range(i, _N):
                p[i][j] = p[j][i] = (p[i][j] - gain[i] * px[j]) / _FORGET
            p[i][i] = max(p[i][i], 1e-12)
        scale = [min(1.0, math.sqrt(self.prior_var[i] / p[i][i])) if p[i][i] > 0 else 1.0 for i in range(_N)]
        for i in range(_N):
            for j in range(_N):
                p[i][j] *= scale[i] * scale[j]
        self.n += 1


SIZES = st.builds(
    PromptSize,
    ascii=st.integers(0, 20_000),
    cjk=st.integers(0, 3_000),
    other=st.integers(0, 500),
    messages=st.integers(0, 12),
    media=st.integers(0, 3),
)


@pytest.mark.python_only
@settings(max_examples=200, deadline=None)
@given(seen=st.lists(st.tuples(SIZES, st.floats(0.2, 3.0)), max_size=60), probe=SIZES)
def test_flat_fit_learns_and_predicts_as_the_loops_did(
    seen: list[tuple[PromptSize, float]], probe: PromptSize
) -> None:
    estimator = TokenEstimator(3.7)
    prior = estimator._prior
    flat, loops = _Fit(prior), _LoopFit(prior)
    for size, ratio in seen:
        y = float(max(1, round((size.ascii / 4 + size.cjk + size.messages * 3) * ratio)))
        flat.update(_features(size), y)
        loops.update(_features(size), y)
        assert (flat.w, flat.p) == (loops.w, loops.p)
    assert flat.predict(_features(probe)) == loops.predict(_features(probe))
    expected = sum(wi * xi for wi, xi in zip(loops.w, _features(probe), strict=True)) + probe.tokens
    estimator._fits["m"] = flat
    assert estimator.estimate("m", probe) == (max(1, round(expected)) if math.isfinite(expected) else 1)
    assert calibration._N == 6
