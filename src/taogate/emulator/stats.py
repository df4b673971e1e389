"""Per-instance bookkeeping behind ``GET /emulator/stats``: counters, tag counts, recent requests.

vLLM users grep request tags in server logs to see which card served what; the emulator keeps the same
facts as data (the last ``N`` requests, with their id, tag, token counts and times) so tests can ask
which instance served which request, and when.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RequestRecord", "StatsBook"]


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request as the emulator saw it. Times are on the instance clock (wall time by default)."""

    id: str
    tag: str | None
    kind: str
    arrival: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    status: int = 200

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsBook:
    """Counters over the instance's life plus a bounded window of recent request records."""

    def __init__(self, keep: int) -> None:
        self.requests_seen = 0
        self.in_flight = 0
        self.completed = 0
        self.aborted = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.tags: Counter[str] = Counter()
        self.records: deque[RequestRecord] = deque(maxlen=keep)

    def begin(self, record: RequestRecord) -> None:
        self.requests_seen += 1
        self.in_flight += 1
        if record.tag is not None:
            self.tags[record.tag] += 1

    def end(self, record: RequestRecord) -> None:
        self.in_flight -= 1
        if record.status >= 400:
            self.errors += 1
        elif record.finish_reason == "abort":
            self.aborted += 1
        else:
            self.completed += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.generation_tokens += record.completion_tokens
        self.records.append(record)

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_seen": self.requests_seen,
            "in_flight": self.in_flight,
            "completed": self.completed,
            "aborted": self.aborted,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generation_tokens": self.generation_tokens,
            "tags": dict(self.tags),
            "records": [r.as_dict() for r in self.records],
        }
