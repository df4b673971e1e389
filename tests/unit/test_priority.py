"""Priority classes: parsing, the body splice, the queue's order and its reserved share."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.types import RequestFacts
from taogate.errors import BadRequest
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.lease import Lease
from taogate.fleet.priority import WaitOrder
from taogate.proxy.multipart import FormHead
from taogate.proxy.priority import priority_of, resolve
from taogate.proxy.splice import with_fields
from tests.unit.test_dispatcher import one_slot_fleet, untimed


def test_the_class_comes_from_x_priority_then_x_vllm_priority_then_the_body() -> None:
    assert priority_of(None, None, {}) == 0
    assert priority_of(None, None, {"priority": 5}) == 5
    assert priority_of(b"2", None, {"priority": 5}) == 2
    assert priority_of(None, b" -1 ", {"priority": 5}) == -1
    assert priority_of(None, None, {"priority": "7"}) == 7  # vLLM's lax validation
    assert priority_of(None, None, {"priority": 3.0}) == 3
    for bad in ({"priority": 1.5}, {"priority": "high"}, {"priority": [1]}):
        with pytest.raises(BadRequest):
            priority_of(None, None, bad)
    with pytest.raises(BadRequest):
        priority_of(b"urgent", None, None)


def test_what_a_priority_instance_is_told() -> None:
    assert resolve(None, None, {"priority": 5}, "body") == (5, None)  # the body says it already
    assert resolve(b"5", None, {}, "body") == (5, 5)
    assert resolve(b"5", None, {"priority": 5}, "body") == (5, None)
    assert resolve(None, None, {"priority": 5}, "header") == (5, 5)  # Messages: no body field
    assert resolve(b"0", None, {"priority": 5}, "header") == (0, None)
    assert resolve(b"5", None, {"priority": 5}, "none") == (5, None)
    assert resolve(None, None, {"priority": "high"}, "none") == (0, None)  # not read there


@given(
    body=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=4),
    pad=st.sampled_from(["", " ", "\n  "]),
    value=st.integers(-(2**63), 2**63 - 1),
)
def test_property_a_spliced_field_wins_and_the_rest_is_kept(
    body: dict[str, object], pad: str, value: int
) -> None:
    raw = (json.dumps(body) + pad).encode()
    spliced = json.loads(with_fields(raw, b'"priority":' + str(value).encode()))
    assert spliced == {**body, "priority": value}


@dataclass
class Item:
    key: tuple[int, int]


@settings(max_examples=200, deadline=None)
@given(
    every=st.integers(1, 6),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), min_size=1, max_size=80),
)
def test_property_the_oldest_waiter_is_never_passed_over_every_times(
    every: int, ops: list[tuple[bool, int]]
) -> None:
    order: WaitOrder[Item] = WaitOrder(every)
    arrivals = 0
    skipped = 0
    for add, priority in ops:
        if add or not len(order):
            order.add(Item((priority, arrivals)))
            arrivals += 1
            continue
        chosen = next(order.offers())  # a slot any waiter could take goes to the first offered
        oldest = min(w.key[1] for w in order.offers())
        skipped = 0 if chosen.key[1] == oldest else skipped + 1
        assert skipped <= every - 1
        if skipped == 0 and chosen.key[1] != min(w.key for w in order.offers())[1]:
            assert order.passed_over == every - 1  # the oldest was offered out of turn: it was due
        order.granted(chosen)


def one_slot(oldest_every: int) -> tuple[Dispatcher, Lease]:
    _, d = one_slot_fleet(queue_timeout=30)
    d.rules = dataclasses.replace(d.rules, queue_size=1000, oldest_every=oldest_every)
    held = d.try_acquire(RequestFacts(None, 10, False))
    assert held is not None
    return d, held[0]


async def serve_in_turn(
    d: Dispatcher, held: Lease, waiters: dict[str, asyncio.Task[object]], n: int
) -> list[str]:
    """Release the one slot ``n`` times; the names of the waiters it went to, in order."""
    got: list[str] = []
    lease = held
    for _ in range(n):
        lease.release()
        await asyncio.sleep(0)
        name = next(k for k, t in waiters.items() if t.done() and k not in got)
        got.append(name)
        lease = waiters[name].result()[0]  # type: ignore[index]
    lease.release()
    return got


async def queue(d: Dispatcher, name: str, priority: int, into: dict[str, asyncio.Task[object]]) -> None:
    facts = RequestFacts(None, 10, False, priority=priority)
    into[name] = asyncio.ensure_future(d.wait_for_slot(facts, frozenset(), untimed))
    await asyncio.sleep(0)


async def test_urgent_requests_behind_ten_batch_ones_are_served_first() -> None:
    d, held = one_slot(oldest_every=4)
    waiters: dict[str, asyncio.Task[object]] = {}
    for i in range(10):
        await queue(d, f"batch{i}", 5, waiters)
    for i in range(2):
        await queue(d, f"urgent{i}", 0, waiters)
    order = await serve_in_turn(d, held, waiters, 12)
    assert order[:2] == ["urgent0", "urgent1"]
    assert order[2:] == [f"batch{i}" for i in range(10)]


async def test_a_flood_of_urgent_requests_leaves_the_reserved_share_to_the_oldest() -> None:
    d, held = one_slot(oldest_every=4)
    waiters: dict[str, asyncio.Task[object]] = {}
    for i in range(3):
        await queue(d, f"batch{i}", 5, waiters)
    for i in range(40):  # the flood: always more urgent requests waiting than the slot can serve
        await queue(d, f"urgent{i}", 0, waiters)
    order = await serve_in_turn(d, held, waiters, 16)
    assert [i for i, name in enumerate(order) if name.startswith("batch")] == [3, 7, 11]
    for task in waiters.values():
        task.cancel()
    await asyncio.gather(*waiters.values(), return_exceptions=True)


async def test_one_means_arrival_order() -> None:
    d, held = one_slot(oldest_every=1)
    waiters: dict[str, asyncio.Task[object]] = {}
    for i, priority in enumerate([5, 0, 9, 0]):
        await queue(d, f"w{i}", priority, waiters)
    assert await serve_in_turn(d, held, waiters, 4) == ["w0", "w1", "w2", "w3"]


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        extra = f'; filename="{filename}"' if filename else ""
        out += b"--B\r\n" + f'content-disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode()
        out += value + b"\r\n"
    return out + b"--B--\r\n"


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_the_form_s_model_is_read_from_the_fields_before_the_file(split: int) -> None:
    body = form(("language", b"en", None), ("model", b"whisper-1", None), ("file", b"\x00" * 300, "a.wav"))
    head = FormHead(b"B")
    for i in range(0, len(body), split):
        head.feed(body[i : i + split])
        if head.done:
            break
    assert head.model == "whisper-1" and i < len(body) - 300
    late = FormHead(b"B")
    late.feed(form(("file", b"\x00" * 30, "a.wav"), ("model", b"whisper-1", None)))
    assert late.done and late.model is None  # after the file: dispatched without a model
