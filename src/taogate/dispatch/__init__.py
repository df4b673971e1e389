"""Dispatch decisions over plain data (``types``): no I/O, clocks injected, tested without a network.

Modules, one concept each: ``tokens`` and ``calibration`` (prompt size and its per-model
calibration), ``prefix`` and ``prefix_chains`` (prefix keys), ``blocks`` and ``token_ids`` (vLLM's
block hashes), ``cache_model`` (an instance's prefix cache, modelled), ``affinity`` (key →
preferred instance), ``load`` (expected time to first token and to the end), ``speed`` with
``speed_params`` and ``speed_state`` (learned prefill speed, fixed latency and decode pace),
``pending`` (a bound on speed from requests still without a first token), ``slow`` (slow-instance
detection), ``policy`` (round robin, least requests, least busy), ``receipt`` (why a request went
where it went) and ``admission`` (send, wait or refuse).
"""

from .admission import decide, retry_after_seconds
from .calibration import TokenEstimator
from .load import LoadModel, expected_ttft
from .policy import STRATEGIES, LeastBusy, Policy, RoundRobin, make_policy
from .prefix import SharedPrefix, prefix_key, shared_prefix
from .slow import SlowRule, slow_instances, unsure_slow
from .speed import SpeedEstimator, SpeedStat
from .tokens import PromptSize, TokenizerUnavailable, load_exact_counter, measure
from .types import Decision, EngineStats, InstanceView, Refuse, RequestFacts, Send, Wait

__all__ = [
    "STRATEGIES",
    "Decision",
    "EngineStats",
    "InstanceView",
    "LeastBusy",
    "LoadModel",
    "Policy",
    "PromptSize",
    "Refuse",
    "RequestFacts",
    "RoundRobin",
    "Send",
    "SharedPrefix",
    "SlowRule",
    "SpeedEstimator",
    "SpeedStat",
    "TokenEstimator",
    "TokenizerUnavailable",
    "Wait",
    "decide",
    "expected_ttft",
    "load_exact_counter",
    "make_policy",
    "measure",
    "prefix_key",
    "retry_after_seconds",
    "shared_prefix",
    "slow_instances",
    "unsure_slow",
]
