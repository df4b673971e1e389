"""Why a KV-event index is trusted or not, in words: the log line, the metric's label, the views.

An index is trusted when it holds every block the engine holds (as far as can be proven); then
dispatch runs on it. Otherwise dispatch runs on the approximate cache model, helped by the blocks
indexed so far. ``Trust`` is the current state: a reason from a fixed set (the metric's label
values) and a detail for the log. ``trust_message`` is the one line said when it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

__all__ = ["REASONS", "TRUSTED", "Reason", "Trust", "trust_message"]

Reason = Literal[
    "from_start",
    "replayed",
    "restart",
    "quiet",
    "cleared",
    "old_blocks_gone",
    "waiting",
    "missed_start",
    "gap",
    "restart_missed",
    "unreadable",
    "off",
]
REASONS: Final[tuple[Reason, ...]] = get_args(Reason)
TRUSTED: Final = frozenset({"from_start", "replayed", "restart", "quiet", "cleared", "old_blocks_gone"})

#: What happened, in a few words (the log line's head).
_WHAT: Final[dict[str, str]] = {
    "from_start": "there from the start",
    "replayed": "recovered",
    "restart": "restart",
    "quiet": "idle engine",
    "cleared": "cache cleared",
    "old_blocks_gone": "recovered",
    "waiting": "subscribed",
    "missed_start": "missed start",
    "gap": "gap",
    "restart_missed": "restart, start missed",
    "unreadable": "unreadable batch",
    "off": "hashes differ",
}


@dataclass(frozen=True, slots=True)
class Trust:
    reason: Reason
    detail: str = ""

    @property
    def trusted(self) -> bool:
        return self.reason in TRUSTED


def trust_message(name: str, trust: Trust, *, replay: bool) -> str:
    """The line said when an instance's trust changes: what happened, why, and what dispatch does."""
    head = f"instance {name}: precise mode"
    what = _WHAT[trust.reason]
    if trust.trusted:
        return f"{head} on, {what}: {trust.detail}; dispatch uses the KV-event index"
    if trust.reason == "off":
        return f"{head} off, {what}: {trust.detail}; dispatch uses the approximate cache model"
    if trust.reason == "waiting":
        until = "its first batch, its replay or its counters show the index complete"
    elif replay:
        until = "a replay from its kv_events_replay socket fills what is missing"
    else:
        until = (
            "the index is provably complete (the engine restarts or clears its cache, or evicts every "
            "block it held before; set kv_events_replay to recover at once)"
        )
    return (
        f"{head} degraded, {what}: {trust.detail}; dispatch uses the approximate cache model "
        f"(and the blocks indexed so far) until {until}"
    )
