"""The prompt-token estimate per model: ``PromptSize`` features to tokens, calibrated online.

Several character classes, not one chars-per-token ratio: English runs about 4 characters per token,
Chinese or Japanese 1–1.5, so one ratio fitted on mixed traffic is wrong for both. The fit is
recursive least squares with the configured guess as its prior: each coefficient is learned as soon
as traffic exercises it, the prior holds where traffic has not, and a clamped innovation keeps one
odd response from dragging it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from taogate.dispatch.tokens import PromptSize

__all__ = ["TokenEstimator"]


#: Feature order of the fitted rule; ``tokens`` is exact and not fitted.
_N: Final = 6  # ascii, cjk, other, messages, media, bias

#: Prior coefficients besides ASCII (which comes from ``chars_per_token``) and their plausible ranges.
_CJK_PRIOR: Final = 0.8  # ~1.25 chars per token
_OTHER_PRIOR: Final = 0.5
_MESSAGE_PRIOR: Final = 4.0  # role markers and separators of a chat template
_MEDIA_PRIOR: Final = 512.0  # an image is hundreds to a few thousand tokens; fitted per model
_BIAS_PRIOR: Final = 1.0  # BOS and friends
_LOWER: Final = (0.02, 0.05, 0.02, 0.0, 0.0, -16.0)
_UPPER: Final = (2.0, 4.0, 4.0, 64.0, 20_000.0, 256.0)

#: Observation noise: a fraction of the prediction plus a few tokens (template quirks, rounding).
_REL_NOISE: Final = 0.03
_ABS_NOISE: Final = 3.0
_CLAMP_SIGMAS: Final = 3.0  # innovations beyond this many sigmas are clipped (Huber-style)
_FORGET: Final = 0.995  # slow forgetting, so a model that changes is relearned


#: One request's features, in the coefficients' order. A fixed-length tuple of floats compiles to
#: unboxed fields, where ``tuple[float, ...]`` boxes each.
Features = tuple[float, float, float, float, float, float]


def _dot(w: list[float], x: Features) -> float:
    """The products of ``w`` and ``x`` added in feature order: the value ``sum`` of them gives
    (the same additions, after an integer 0), with no tuple of boxed products to build."""
    return w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3] + w[4] * x[4] + w[5] * x[5]


def _features(size: PromptSize) -> Features:
    return (
        float(size.ascii),
        float(size.cjk),
        float(size.other),
        float(size.messages),
        float(size.media),
        1.0,
    )


class _Fit:
    """Recursive least squares for one model: coefficients ``w`` and their covariance ``p``."""

    __slots__ = ("n", "p", "prior_var", "w")

    def __init__(self, prior: Sequence[float]) -> None:
        self.w = list(prior)
        # Prior standard deviation: the prior coefficient itself (±100 %), a token or two for the bias.
        self.prior_var = [max(abs(c), 2.0 if i == _N - 1 else 0.0) ** 2 for i, c in enumerate(prior)]
        self.p = [[self.prior_var[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self.n = 0

    def predict(self, x: Features) -> float:
        return _dot(self.w, x)

    def update(self, x: Features, y: float) -> None:
        """One RLS step. Each sum over the six features is ``_dot``, written out (a generator per
        sum cost more than the arithmetic); it adds the same products in the same order as a loop
        over the features, so the fit is the same float for float (a property test holds it)."""
        p = self.p
        px = [_dot(r, x) for r in p]
        xpx = _dot(px, x)
        pred = self.predict(x)
        noise = (_REL_NOISE * max(y, pred, 1.0)) ** 2 + _ABS_NOISE**2
        s = xpx + noise
        if not (s > 0.0 and math.isfinite(s)):
            return
        residual = y - pred
        bound = _CLAMP_SIGMAS * math.sqrt(s)
        residual = max(-bound, min(bound, residual))
        gain = [v / s for v in px]
        w = self.w
        for i in range(_N):
            w[i] = min(_UPPER[i], max(_LOWER[i], w[i] + gain[i] * residual))
        for i in range(_N):
            row, g = p[i], gain[i]
            for j in range(i, _N):  # kept symmetric by construction
                row[j] = p[j][i] = (row[j] - g * px[j]) / _FORGET
            row[i] = max(row[i], 1e-12)
        # Forgetting inflates the covariance of directions the traffic never excites; cap it at the
        # prior so an unused coefficient does not become arbitrarily jumpy (scaling D·P·D keeps P PSD).
        prior_var = self.prior_var
        scale = [min(1.0, math.sqrt(prior_var[i] / p[i][i])) if p[i][i] > 0 else 1.0 for i in range(_N)]
        for i in range(_N):
            row, si = p[i], scale[i]
            for j in range(_N):
                row[j] *= si * scale[j]
        self.n += 1


class TokenEstimator:
    """Estimated prompt tokens per model, calibrated online from vLLM's ``usage.prompt_tokens``.

    Bounded memory: at most ``max_models`` fits, least recently used evicted. A model never seen uses
    the prior rule (``chars_per_token`` for ASCII, about 1.25 characters per token for CJK).
    """

    def __init__(self, chars_per_token: float = 4.0, *, max_models: int = 256) -> None:
        if not chars_per_token > 0:
            raise ValueError("chars_per_token must be positive")
        ascii_prior = min(_UPPER[0], max(_LOWER[0], 1.0 / chars_per_token))
        # What a model with no fit yet estimates with, and each new fit starts from.
        self._prior = [ascii_prior, _CJK_PRIOR, _OTHER_PRIOR, _MESSAGE_PRIOR, _MEDIA_PRIOR, _BIAS_PRIOR]
        self._max_models = max(1, max_models)
        self._fits: OrderedDict[str, _Fit] = OrderedDict()

    def estimate(self, model: str | None, size: PromptSize) -> int:
        """Estimated prompt tokens: always a finite integer ≥ 1."""
        fit = self._fits.get(model or "")
        w = fit.w if fit is not None else self._prior
        value = _dot(w, _features(size)) + size.tokens
        if not math.isfinite(value):
            return 1
        return max(1, round(value))

    def observe(self, model: str | None, size: PromptSize, prompt_tokens: int) -> None:
        """Learn from one response's ``usage.prompt_tokens`` for a request of ``size``."""
        if prompt_tokens <= 0:
            return
        key = model or ""
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = _Fit(self._prior)
            while len(self._fits) > self._max_models:
                self._fits.popitem(last=False)
        else:
            self._fits.move_to_end(key)
        fit.update(_features(size), float(prompt_tokens - size.tokens))

    def observations(self, model: str | None) -> int:
        fit = self._fits.get(model or "")
        return 0 if fit is None else fit.n

    def coefficients(self, model: str | None) -> dict[str, float]:
        """The current rule, for status pages and logs."""
        fit = self._fits.get(model or "")
        w = fit.w if fit is not None else self._prior
        return dict(zip(("ascii", "cjk", "other", "message", "media", "bias"), w, strict=True))

    def __len__(self) -> int:
        return len(self._fits)
