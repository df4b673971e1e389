"""An instance's batch slots, learned from its scrapes' running and waiting counts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from taogate.fleet.slots import BatchSlots


def test_unknown_until_requests_wait_while_the_most_run() -> None:
    slots = BatchSlots()
    slots.served(1.0)
    for running, waiting in ((1, 0), (2, 0), (None, 3), (1, 2)):  # waiting below the most: a busy step
        slots.observe(running, waiting)
    assert slots.limit == 0 and slots.wait == 0.0
    slots.observe(2, 1)
    assert slots.limit == 2 and slots.wait == 0.5  # one of two answers of ~1 s ends every 0.5 s


def test_requests_held_back_by_the_token_budget_do_not_make_a_limit() -> None:
    # Four long prompts of ours there, none with a first token: one prefills in chunks, the rest
    # wait for the step's token budget, which the queued prefill already costs.
    slots = BatchSlots()
    slots.observe(1, 3, prefilling=4)
    assert slots.limit == 0
    slots.observe(2, 1, prefilling=1)  # two decode, the one without a first token waits: full
    assert slots.limit == 2


def test_more_running_than_the_limit_makes_it_unknown_again() -> None:
    slots = BatchSlots()
    slots.observe(2, 1)
    slots.observe(3, 0)  # shorter prompts: the KV cache admits more
    assert slots.limit == 0
    slots.observe(3, 2)
    assert slots.limit == 3


def test_the_answer_time_follows_new_answers() -> None:
    slots = BatchSlots()
    slots.served(1.0)
    slots.served(0.0)  # nothing measured: ignored
    slots.served(2.0)
    assert 1.0 < slots.served_seconds < 2.0


@given(st.lists(st.tuples(st.none() | st.floats(0, 64), st.none() | st.floats(0, 64)), max_size=30))
def test_property_the_limit_is_never_below_what_ran_and_never_above_the_most(
    scrapes: list[tuple[float | None, float | None]],
) -> None:
    slots = BatchSlots()
    most = 0
    for running, waiting in scrapes:
        slots.observe(running, waiting, prefilling=1)
        most = max(most, int(running or 0))
        assert slots.limit in (0, most)
        assert slots.wait >= 0.0
