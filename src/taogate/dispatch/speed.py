"""Each instance's prefill speed (prompt tokens/s), learned online (``slow`` flags the slow cards from it).

Dividing load by a learned speed gives a slow instance proportionally less work, unconfigured.
``ttft ≈ base + work / speed``: each request teaches once, from its stream's first token (the work
booked ahead of it plus its own uncached tokens) or from what the engine itself measured between two
scrapes (vLLM's per-request phase histograms). A TTFT that the engine's own phases show was lost
outside its prefill teaches nothing. The fit is an EWMA of ``log(speed)`` weighted by the work each
sample covers, seeded from the fleet's median; a speed learned without the engine's phases is capped
at ``fast_cap`` × the others' median, as unseen prefix-cache hits would make a card look fast.
Why each rule, and what went wrong without it: benchmarks/README.md, "Design notes moved from the
code".
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

from .speed_params import derive, fleet_median
from .speed_state import SpeedStat, State

__all__ = ["ALPHA", "SpeedEstimator", "SpeedStat"]


#: The EWMA step of a learned speed (``alpha``): it rests on about ``(2 - ALPHA) / ALPHA`` samples.
ALPHA = 0.3
#: How many full-size samples the configured seed is worth: little, the first real sample dominates.
_SEED_WEIGHT = 0.1
#: At most this many requests of one engine window count as separate samples (some memory stays).
_MAX_WINDOW_WEIGHT = 8.0
#: Held first tokens beyond this many teach at once, oldest first (the engine's windows stopped).
_MAX_HELD = 32
#: Held TTFTs that took more than this many times the engine's own time for a request (waiting
#: for a slot plus prefill) and the fixed latency, and ``_OUTSIDE_SECONDS`` more, were held up
#: outside the engine's prefill.
_OUTSIDE_RATIO = 2.0
_OUTSIDE_SECONDS = 0.05


class SpeedEstimator:
    """Learned prefill speed per instance name. Not thread-safe; the gateway's event loop owns it."""

    def __init__(
        self,
        nominal: float = 10_000.0,
        *,
        weights: Mapping[str, float] | None = None,
        alpha: float = ALPHA,
        clamp: float = 3.0,
        fast_cap: float = 2.0,
        ref_tokens: float = 256.0,
        decode_seconds_per_token: float = 0.02,
        small_tokens: float = 128.0,
        base_latency: float = 0.0,
        rebuild_every: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (nominal > 0 and 0 < alpha <= 1 and clamp > 1 and fast_cap >= 1):
            raise ValueError("need nominal > 0, 0 < alpha <= 1, clamp > 1, fast_cap >= 1")
        self._nominal = nominal
        self._alpha = alpha
        self._log_clamp = math.log(clamp)
        self._fast_cap = fast_cap
        self._ref = ref_tokens
        self._tpot = decode_seconds_per_token
        self._small = max(0.0, small_tokens)
        self._base_prior = max(0.0, base_latency)
        self._states: dict[str, State] = {}
        self._speeds: dict[str, float] = {}
        self._base = nominal
        # What dispatch reads per instance, (speed, base latency, seconds per output token), rebuilt
        # lazily: samples only mark it stale, so a burst of them costs one rebuild, not one each.
        self._params: dict[str, tuple[float, float, float]] = {}
        self._stale = False
        # Dispatch's read (``params``) rebuilds at most once per ``rebuild_every`` seconds of
        # ``clock`` (0: on every read after a change): a few milliseconds of lag in a learned speed
        # changes no decision, while a rebuild per response at high rates cost more than the rest of
        # the learning (measured: benchmarks/overhead.py). Every other read, and a new or removed
        # instance, rebuilds at once.
        self._rebuild_every = max(0.0, rebuild_every)
        self._clock = clock
        self._built = -math.inf
        # Bumped whenever what dispatch reads may have changed (``params``, ``uncached_ratio``):
        # dispatch keeps its views of the instances while it stays put (``settled``).
        self.version = 0
        for name, weight in (weights or {}).items():
            self.seed(name, weight)

    # --- registry ------------------------------------------------------------------------------------

    def seed(self, name: str, weight: float = 1.0) -> None:
        """Register an instance with its configured weight; a known one keeps what it has learned."""
        weight = max(weight, 1e-6)
        state = self._states.get(name)
        self._fresh()
        if state is None:
            self._states[name] = State(math.log(weight * self._base), weight, self._tpot, self._base_prior)
        else:
            state.weight = weight
        self._stale = True
        self._built = -math.inf

    def forget(self, name: str) -> None:
        self._states.pop(name, None)
        self._stale = True
        self._built = -math.inf

    def restart(self, name: str, prompt_tokens: float) -> None:
        """What ``name``'s speed and fixed latency rest on is stale (a card measured again after a
        long idle spell) and a measurement of ``prompt_tokens`` is to replace it: its next samples
        count as its first, from the fleet's scale. Not for a prompt under ``small_tokens``, which
        teaches no speed. Its decode pace, cache share and the spread of its samples are kept."""
        state = self._states.get(name)
        if state is not None and prompt_tokens >= self._small:
            state.evidence, state.base_n = 0.0, 0
            self._stale = True

    def _fresh(self, lag_ok: bool = False) -> None:
        if self._stale and (
            not lag_ok or self._rebuild_every <= 0 or self._clock() - self._built >= self._rebuild_every
        ):
            self._refresh()

    def _state(self, name: str) -> State:
        state = self._states.get(name)
        if state is None:
            self.seed(name)
            state = self._states[name]
        return state

    def _refresh(self) -> None:
        """Recompute what dispatch reads (``speed_params.derive``; after every change)."""
        derived = derive(
            self._states,
            nominal=self._nominal,
            fast_cap=self._fast_cap,
            base_prior=self._base_prior,
            tpot_prior=self._tpot,
        )
        self._base, self._speeds, self._params = derived.unit, derived.speeds, derived.params
        self._stale = False
        self.version += 1
        if self._rebuild_every > 0:
            self._built = self._clock()

    # --- samples -------------------------------------------------------------------------------------

    def _learn(self, state: State, sample: float, work: float, trust: float, *, count: float = 1.0) -> float:
        first = state.evidence <= 0
        if first:  # start from the fleet's scale, not from a seed that may be stale
            self._fresh()
            state.log_speed = math.log(state.weight * self._base)
        log_sample = math.log(sample)
        if state.evidence >= 3.0:  # warm: one stalled or lucky request moves the estimate only so far
            lo, hi = state.log_speed - self._log_clamp, state.log_speed + self._log_clamp
            log_sample = min(hi, max(lo, log_sample))
        if not first:
            # How far samples stray from the estimate: the slow-card detector's yardstick. A window's
            # sample is a mean of ``count`` requests, which strays by a root of ``count`` less.
            deviation = log_sample - state.log_speed
            state.dev_n += 1
            step = max(self._alpha, 1.0 / state.dev_n)
            state.dev2 += step * (deviation * deviation * min(count, _MAX_WINDOW_WEIGHT) - state.dev2)
        weight = trust * work / (work + self._ref) * count
        # A weighted running mean (the seed counting as a tenth of a sample) until the EWMA is faster;
        # ``count`` equal samples at once move the EWMA as far as that many one by one.
        ewma = 1.0 - (1.0 - self._alpha) ** weight
        alpha = max(ewma, weight / (state.evidence + weight + _SEED_WEIGHT))
        state.log_speed += alpha * (log_sample - state.log_speed)
        state.n += max(1, round(count))
        state.evidence += weight
        self._stale = True
        return math.exp(log_sample)

    def _work(self, state: State, ahead: float, uncached: float, prompt: float | None) -> float:
        """Prefill work the sample covers, the work booked ahead (whole prompts) discounted by the
        instance's recent uncached share: on a card whose prompts mostly hit the cache most of it was
        never prefilled, and cache hits must not pass for a fast card."""
        if prompt is not None and prompt > 0:
            ratio = min(1.0, max(0.01, uncached / prompt))
            if ratio != state.uncached_ratio:
                state.uncached_ratio += max(0.3, 1.0 / (state.n + state.base_n + 1)) * (
                    ratio - state.uncached_ratio
                )
                self.version += 1
        return max(0.0, ahead) * state.uncached_ratio + max(0.0, uncached)

    def _sample(self, state: State, own: float, work: float, seconds: float, trust: float) -> float | None:
        """Split one (work, seconds-to-first-token) observation into the fixed part and the speed.

        Small work (< ``small_tokens``) is mostly fixed latency: it updates ``base`` only. Larger work
        is a speed sample over the time left after ``base`` (never under a quarter of the whole, so a
        base learned on a quiet instance cannot turn a busy one's sample into an absurd speed), trusted
        by the share of its work that was measured (``own``: its uncached prompt) rather than booked
        ahead (an estimate: booked work that never happened would read as a fast card and feed on it).
        """
        trust *= own / max(work, 1e-9)
        if work < self._small:
            state.base_n += 1
            step = max(0.2, 1.0 / state.base_n)
            state.base += step * (seconds - state.base)
            self._stale = True
            return None
        prefill = max(seconds - state.base, 0.25 * seconds)
        return self._learn(state, work / prefill, work, trust)

    def observe_first_token(
        self,
        name: str,
        *,
        ttft: float,
        ahead_tokens: float,
        uncached_tokens: float | None,
        prompt_tokens: float | None = None,
        exact: bool = False,
        queued: bool = False,
        hold: bool = False,
    ) -> float | None:
        """Learn from a first token after ``ttft`` s; returns the sample used, or None if unusable
        or held.

        ``prompt_tokens`` (cache hits included) teaches how much of the queued work the prefix cache
        saves. ``uncached_tokens`` None: vLLM did not say which were hits; where the engine reports
        its phases, its computed share stands in. ``exact``: nothing could hit the cache (a salted
        warm-up). ``queued``: the engine had requests waiting, so the TTFT may include a wait for a
        batch slot no booked work explains; where the engine reports phases, its window teaches it.
        ``hold``: the instance's engine stats are fresh, so its next window will come; where it
        reports phases, the sample waits for that window to vouch for it (module docstring).
        """
        state = self._state(name)
        if uncached_tokens is None:
            if not state.engine or prompt_tokens is None:
                uncached_tokens = prompt_tokens or 0.0
            else:
                uncached_tokens = prompt_tokens * state.uncached_ratio
                prompt_tokens = None  # the ratio is the engine's: nothing new to learn from it here
        if not (ttft > 0 and math.isfinite(ttft) and math.isfinite(ahead_tokens + uncached_tokens)):
            return None
        if queued and state.engine:
            return None
        work = self._work(state, ahead_tokens, uncached_tokens, prompt_tokens)
        if work <= 0:
            return None
        state.guessed |= not exact
        state.taught += 1
        own = max(0.0, uncached_tokens)
        waits = hold and state.engine and not exact
        if not waits:
            self._settle(state)  # no window to wait for: what was held teaches as it came
        # Small work teaches the fixed latency: time outside the engine by nature, never held.
        if not waits or work < self._small:
            return self._sample(state, own, work, ttft, 1.0)
        state.held.append((ttft, own, work))
        if len(state.held) > _MAX_HELD:
            ttft, own, work = state.held.pop(0)
            self._sample(state, own, work, ttft, 1.0)
        return None

    def _pace(self, name: str, state: State, pace: float, step: float) -> None:
        """A decode-pace sample moves the estimate by ``step``. A first one moves the pace dispatch
        priced the instance at (the others', scaled for a slower card), not the configured prior:
        from the prior, one slow window could price a newcomer far above the others (and then no
        work would correct it), or a slow card's first one price it near the fast ones."""
        if not state.tpot_n:
            state.tpot = self.decode_seconds_per_token(name)
        state.tpot += step * (pace - state.tpot)
        state.tpot_n += 1
        self._stale = True

    def _settle(self, state: State) -> None:
        """Held first tokens teach as they came."""
        held, state.held = state.held, []
        for ttft, own, work in held:
            self._sample(state, own, work, ttft, 1.0)

    def settle(self, name: str) -> None:
        """A scrape brought no engine window: the first tokens held for one teach as they came."""
        state = self._states.get(name)
        if state is not None and state.held:
            self._settle(state)

    def observe_completion(
        self,
        name: str,
        *,
        duration: float,
        completion_tokens: int,
        ahead_tokens: float,
        uncached_tokens: float,
        prompt_tokens: float | None = None,
        ttft: float | None = None,
    ) -> float | None:
        """Learn from a finished request: with ``ttft`` (streams) its decode pace only; without, the
        prefill as the duration less the decode at the pace learned from streams. Returns the speed
        sample used (None when no pace is known yet, decoding dominates, or data is bad)."""
        if not (duration > 0 and math.isfinite(duration)):
            return None
        state = self._state(name)
        if ttft is not None:
            if state.engine:
                return None  # the engine's window teaches the decode pace
            if completion_tokens > 1 and duration > ttft:
                self._pace(name, state, (duration - ttft) / (completion_tokens - 1), 0.2)
            return None
        decoded = max(0, completion_tokens - 1)
        if state.engine:
            return None  # its prefill is in the engine's window, without the decode to guess at
        if not math.isfinite(ahead_tokens + uncached_tokens) or (decoded and not state.tpot_n):
            return None
        work = self._work(state, ahead_tokens, uncached_tokens, prompt_tokens)
        prefill = duration - decoded * state.tpot
        if work <= 0 or prefill < 0.25 * duration:
            return None
        state.guessed = True
        state.taught += 1
        return self._sample(state, max(0.0, uncached_tokens), work, prefill, 0.5)  # less sure than a TTFT

    def observe_engine(
        self,
        name: str,
        *,
        requests: float,
        prefill_seconds: float,
        computed_tokens: float,
        prompt_tokens: float | None = None,
        decode_seconds_per_token: float | None = None,
        queue_seconds: float = 0.0,
    ) -> float | None:
        """Learn from what the engine measured over one scrape window (means per finished request),
        for the requests of it not already learned from one by one, and judge the first tokens held
        for it (``queue_seconds``: the mean wait for a slot). Returns the speed sample used."""
        if not (requests >= 1 and prefill_seconds > 0 and math.isfinite(prefill_seconds + computed_tokens)):
            self.settle(name)
            return None
        state = self._state(name)
        state.engine = True
        if state.held:
            took = sum(t for t, _, _ in state.held) / len(state.held)
            inside = max(0.0, queue_seconds) + prefill_seconds + max(0.0, state.base)
            if took > _OUTSIDE_RATIO * inside and took - inside > _OUTSIDE_SECONDS:
                # Held up outside the engine: they teach nothing, the window teaches them instead.
                state.taught = max(0, state.taught - len(state.held))
                state.held = []
            self._settle(state)
        untaught = max(0.0, requests - state.taught)
        state.taught = 0
        count = min(untaught, _MAX_WINDOW_WEIGHT)
        pace = decode_seconds_per_token
        if pace is not None and pace > 0 and math.isfinite(pace):
            self._pace(name, state, pace, 1.0 - 0.8**count)
        if prompt_tokens is not None and prompt_tokens > 0:
            ratio = min(1.0, max(0.01, computed_tokens / prompt_tokens))
            step = max(0.3, 1.0 / (state.n + state.base_n + 1))
            state.uncached_ratio += step * (ratio - state.uncached_ratio)
            self.version += 1
        # The engine timed the prefill itself, from the first step that scheduled it: no HTTP path,
        # no wait for a slot, so the gateway's fixed latency is not in it (subtracting it would
        # make a card look faster by its network path), and a small window says nothing about that
        # latency either. Under ``small_tokens`` a step's own overhead dominates: nothing to learn.
        if computed_tokens < self._small or count < 0.5:
            return None
        return self._learn(state, computed_tokens / prefill_seconds, computed_tokens, 1.0, count=count)

    # --- reading -------------------------------------------------------------------------------------

    def speed(self, name: str) -> float:
        """The speed dispatch should use (an unknown name gets the fleet's median)."""
        self._fresh()
        found = self._speeds.get(name)
        return self._base if found is None else found

    def samples(self, name: str) -> int:
        state = self._states.get(name)
        return 0 if state is None else state.n

    def evidence(self, name: str) -> float:
        """Samples weighted by the work they covered (a 20-token sample counts for little)."""
        state = self._states.get(name)
        return 0.0 if state is None else state.evidence

    def uncached_ratio(self, name: str) -> float:
        """The recent share of this instance's prompt tokens that the prefix cache did not cover."""
        state = self._states.get(name)
        return 1.0 if state is None else state.uncached_ratio

    def base_latency(self, name: str) -> float:
        """The fixed part of this instance's TTFT (seconds): what even a tiny prompt waits. Until it
        has answered a few small requests itself, the lesser of its own and the others' median (an
        instance that never answers must not look the quickest)."""
        self._fresh()
        params = self._params.get(name)
        if params is not None:
            return params[1]
        return fleet_median(self._states, lambda st: st.base if st.base_n > 0 else None, self._base_prior)

    def decode_seconds_per_token(self, name: str) -> float:
        """Learned seconds per output token. Until this instance has a decode sample: the fleet's
        median, scaled up (at most 4x) by how much slower its prefill speed or fixed latency has
        shown it to be: a card whose every engine step is slower decodes slower too."""
        self._fresh()
        params = self._params.get(name)
        if params is not None:
            return params[2]
        return fleet_median(self._states, lambda st: st.tpot if st.tpot_n > 0 else None, self._tpot)

    def settled(self) -> int:
        """Rebuild what ``params`` reads if it is due, and return ``version``: while that stays
        the same, so do ``params`` and ``uncached_ratio`` of every instance (``_fresh`` with
        ``lag_ok``, written out: it runs for every dispatch)."""
        if self._stale and (self._rebuild_every <= 0 or self._clock() - self._built >= self._rebuild_every):
            self._refresh()
        return self.version

    def view_params(self, name: str) -> tuple[tuple[float, float, float], float]:
        """(``params``, ``uncached_ratio``) of one instance in one call, right after ``settled``
        (which rebuilt what ``params`` reads if it was due)."""
        params = self._params.get(name)
        state = self._states.get(name)
        if params is None or state is None:
            return self.params(name), self.uncached_ratio(name)
        return params, state.uncached_ratio

    def params(self, name: str) -> tuple[float, float, float]:
        """(speed, base latency, seconds per output token) of one instance: what a dispatch view
        needs, in one lookup; may lag the latest samples by up to ``rebuild_every``."""
        self._fresh(lag_ok=True)
        params = self._params.get(name)
        if params is None:
            return (self.speed(name), self.base_latency(name), self.decode_seconds_per_token(name))
        return params

    def relative(self, name: str) -> float:
        """Speed relative to the fleet median (1.0 for a lone instance)."""
        self._fresh()
        if not self._speeds:
            return 1.0
        return self.speed(name) / statistics.median(self._speeds.values())

    def snapshot(self) -> dict[str, SpeedStat]:
        """Every instance's speed and sample counts, the input of ``slow_instances``."""
        self._fresh()
        return {
            name: SpeedStat(
                self._speeds[name], st.n, st.evidence, math.sqrt(st.dev2) if st.dev_n >= 2 else 0.0
            )
            for name, st in self._states.items()
        }
