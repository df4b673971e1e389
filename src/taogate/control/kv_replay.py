"""Asking an engine's replay socket for the KV-event batches it still buffers.

vLLM's publisher keeps its last ``buffer_steps`` batches and, asked on its ROUTER socket
(``replay_endpoint``) for those from a sequence number on, sends each, then an end marker.
``Replays`` fills an index from them: every batch from 0 when a subscription starts or finds a
restart it joined late (``ask_whole``), the batches a gap lost (``fill_gap``). A socket that keeps
silent (an engine starved of CPU answers late) is asked again, less and less often, until it
answers (``AskAgain``); the subscriber asks once ``due`` says so.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from taogate.control.kv_endpoints import replay_endpoint
from taogate.control.kv_wire import bounded, decode
from taogate.fleet.instance import Instance
from taogate.fleet.kv_index import KvIndex

__all__ = ["AskAgain", "Replays"]

log = logging.getLogger("taogate.health")

_END: Final = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT: Final = 2.0  # seconds a replay socket may keep silent before an answer is given up
REPLAY_TOTAL: Final = 10.0  # seconds a whole replay may take
ASK_FIRST: Final = 1.0  # seconds before a replay socket that kept silent is asked again ...
ASK_MAX: Final = 30.0  # ... doubling to this
REPLAY_HWM: Final = 200_000  # replayed batches queued on our side (vLLM keeps 10,000 by default)
YIELD_EVERY: Final = 256  # replayed batches applied between turns of the event loop


@dataclass(slots=True)
class AskAgain:
    """When a replay socket that kept silent is asked for every batch again, and how long it may
    then keep silent: ``ASK_FIRST`` s later, doubling to ``ASK_MAX``; its patience doubles from
    ``REPLAY_TIMEOUT`` to ``REPLAY_TOTAL``. ``at`` is infinite while nothing is to be asked."""

    at: float = math.inf
    wait: float = ASK_FIRST
    patience: float = REPLAY_TIMEOUT
    silences: int = 0

    def silent(self, now: float) -> None:
        self.silences += 1
        self.at = now + self.wait
        self.wait = min(2 * self.wait, ASK_MAX)
        self.patience = min(2 * self.patience, REPLAY_TOTAL)

    def answered(self) -> None:
        self.at, self.wait, self.patience, self.silences = math.inf, ASK_FIRST, REPLAY_TIMEOUT, 0


class Replays:
    """The replay asks of one subscriber's instances (``begin`` each subscription, ``end`` it)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._asks: dict[str, AskAgain] = {}  # per subscribed instance

    def begin(self, name: str) -> AskAgain:
        ask = self._asks[name] = AskAgain()
        return ask

    def end(self, name: str) -> None:
        self._asks.pop(name, None)

    def due(self, name: str) -> float:
        """Seconds until ``name``'s silent replay socket is to be asked again (infinite: never)."""
        ask = self._asks.get(name)
        return math.inf if ask is None else max(0.0, ask.at - self._clock())

    def needless(self, name: str) -> None:
        """``name``'s index is trusted: nothing is to be asked."""
        ask = self._asks.get(name)
        if ask is not None:
            ask.answered()

    async def ask_whole(self, inst: Instance, index: KvIndex) -> bool:
        """``catch_up``, and when the replay socket keeps silent, when to ask it again."""
        ask = self._asks.get(inst.name) or AskAgain()
        patience = ask.patience
        if await self.catch_up(inst, index, patience):
            if ask.silences:
                log.info("instance %s: its replay socket answered on ask %d", inst.name, ask.silences + 1)
            ask.answered()
            return True
        self._silent(inst, patience)
        return False

    async def catch_up(self, inst: Instance, index: KvIndex, patience: float = REPLAY_TIMEOUT) -> bool:
        """Ask for every batch from the engine's start: whole at once if it still has them all.
        False when the replay socket did not answer."""
        got = await self._fetch(inst, 0, patience)
        where = replay_endpoint(inst.spec.kv_events_replay or "", inst.spec.url)
        if got is None:
            index.note(f"{index.trust.detail}; its replay socket {where} did not answer")
            return False
        if index.next_seq is not None:  # batches seen since an earlier ask: the replay has them too
            index.start_over(index.trust.reason, index.trust.detail)
        if not got:
            index.recovered(f"its replay socket {where} holds no batch: it has published nothing yet")
            return True
        first = got[0][0]
        try:
            for n, (seq, payload) in enumerate(got, 1):
                ts, events = decode(payload)
                if index.apply(seq, events, ts) == "gap":
                    missing = index.next_seq
                    index.start_over("missed_start", f"its replay skipped batches {missing}..{seq - 1}")
                    index.apply(seq, events, ts)
                if n % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except Exception as exc:
            index.start_over("unreadable", f"a replayed batch could not be read ({exc!r})")
            return True
        if first == 0 and index.trust.reason == "from_start":
            index.recovered(f"its replay socket resent batches 0..{got[-1][0]}")
        elif first > 0 and not index.trusted:
            index.note(f"its replay buffer begins at seq {first}: the batches before are gone (buffer_steps)")
        return True

    async def fill_gap(self, inst: Instance, index: KvIndex, start: int) -> bool | None:
        """Ask the engine for every batch from ``start``; True when they filled the gap, None when
        it did not answer (then it is asked for every batch later)."""
        got = await self._fetch(inst, start)
        if got is None:
            self._silent(inst, REPLAY_TIMEOUT)
            return None
        if not got or got[0][0] != start:
            return False  # the engine no longer has them
        try:
            for n, (seq, payload) in enumerate(got, 1):
                ts, events = decode(payload)
                if index.apply(seq, events, ts) == "gap":
                    return False
                if n % YIELD_EVERY == 0:  # thousands of batches: requests go on meanwhile
                    await asyncio.sleep(0)
        except Exception:  # an unreadable batch: the caller starts over
            return False
        index.replayed()
        return True

    def _silent(self, inst: Instance, patience: float) -> None:
        """The replay socket kept silent for ``patience`` s: it is asked for every batch again later
        (said once, until it answers)."""
        ask = self._asks.get(inst.name)
        if ask is None:  # no subscription running
            return
        ask.silent(self._clock())
        if ask.silences == 1:
            log.warning(
                "instance %s: its replay socket %s did not answer within %g s; asking again, "
                "at most %g s apart, until it does",
                inst.name,
                replay_endpoint(inst.spec.kv_events_replay or "", inst.spec.url),
                patience,
                ASK_MAX,
            )

    @staticmethod
    async def _fetch(
        inst: Instance, start: int, patience: float = REPLAY_TIMEOUT
    ) -> list[tuple[int, bytes]] | None:
        """Every batch the engine still buffers from ``start`` on, in order (None: no answer, or
        silent for ``patience`` s between frames)."""
        zmq = importlib.import_module("zmq")
        context = importlib.import_module("zmq.asyncio").Context.instance()
        dealer = bounded(zmq, context.socket(zmq.DEALER), REPLAY_HWM)  # vLLM sends its buffer at once
        got: list[tuple[int, bytes]] = []
        try:
            dealer.connect(replay_endpoint(inst.spec.kv_events_replay or "", inst.spec.url))
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TOTAL):
                while True:
                    async with asyncio.timeout(patience):
                        frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == _END:
                        return got
                    got.append((int.from_bytes(frames[2], "big"), frames[3]))
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            dealer.close()
