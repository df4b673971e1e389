"""One proxied request's state as it moves through the pipeline: what it is, what goes upstream,
where it was sent, and how far its answer has gone."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Send

from taogate.dispatch.tokens import PromptSize
from taogate.dispatch.types import RequestFacts
from taogate.proxy.forward import Forward
from taogate.proxy.routes import Route
from taogate.request_record import RequestRecord

__all__ = ["Exchange"]


@dataclass(init=False, slots=True)
class Exchange:
    """One proxied request as it moves through the pipeline."""

    route: Route
    facts: RequestFacts
    size: PromptSize
    forward: Forward  # what goes upstream (per attempt, what the instance alone is told)
    rid: bytes
    send: Send
    rec: RequestRecord
    exclude: frozenset[str] = frozenset()  # never these (a stored response lives elsewhere)
    attempt: int = 0  # which attempt this is (1 = the first)
    tried: frozenset[str] = frozenset()  # the instances tried so far, this attempt's included
    started: bool = False  # a response has begun downstream: no more retries, no error JSON
    finished: bool = False  # the last body message is being sent: a disconnect now is not a hang-up

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        route: Route,
        facts: RequestFacts,
        size: PromptSize,
        forward: Forward,
        rid: bytes,
        send: Send,
        rec: RequestRecord,
        exclude: frozenset[str] = frozenset(),
        attempt: int = 0,
        tried: frozenset[str] = frozenset(),
        started: bool = False,
        finished: bool = False,
    ) -> None:
        self.route = route
        self.facts = facts
        self.size = size
        self.forward = forward
        self.rid = rid
        self.send = send
        self.rec = rec
        self.exclude = exclude
        self.attempt = attempt
        self.tried = tried
        self.started = started
        self.finished = finished

    def last_message(self) -> None:
        self.finished = True

    @property
    def reading(self) -> bool:
        return self.forward.reading
