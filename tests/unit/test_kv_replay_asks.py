"""When a replay socket that kept silent is asked again: sooner at first, never more often than
``ASK_FIRST`` apart nor less often than ``ASK_MAX``, with more patience each time; an answer resets it."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from taogate.control.kv_replay import ASK_FIRST, ASK_MAX, REPLAY_TIMEOUT, REPLAY_TOTAL, AskAgain


def test_nothing_is_asked_until_a_silence() -> None:
    assert AskAgain().at == math.inf


def test_the_schedule_doubles_to_its_bounds() -> None:
    ask, now, gaps, patience = AskAgain(), 100.0, [], []
    for _ in range(8):
        patience.append(ask.patience)
        ask.silent(now)
        gaps.append(ask.at - now)
        now = ask.at
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert patience == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    assert ask.silences == 8


@given(st.lists(st.booleans(), max_size=40))
def test_an_answer_resets_and_the_bounds_hold(answers: list[bool]) -> None:
    ask, now = AskAgain(), 0.0
    for answered in answers:
        if answered:
            ask.answered()
            assert ask == AskAgain()
            continue
        ask.silent(now)
        assert ASK_FIRST <= ask.at - now <= ASK_MAX
        assert REPLAY_TIMEOUT <= ask.patience <= REPLAY_TOTAL
        now = ask.at
