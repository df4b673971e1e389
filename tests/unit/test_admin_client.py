"""The admin calls behind ``status``, ``drain`` and ``reload`` hold Ctrl-C until the HTTP call ends:
raised inside httpx's client it could leave its pool's lock held and hang the exit."""

from __future__ import annotations

import signal
import threading

import pytest

from taogate.admin_client import interrupts_held


def test_ctrl_c_inside_the_block_is_raised_when_it_ends() -> None:
    before = signal.getsignal(signal.SIGINT)
    finished: list[bool] = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the call is in flight (in this thread)
        finished.append(True)  # the call runs to its end all the same
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_during_a_call_that_fails_is_not_lost() -> None:
    """``status --watch`` retries a call that could not reach the gateway: a Ctrl-C that came
    during it must still end the watch, not go down with the call's error."""
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)
        raise ConnectionError("the gateway went away meanwhile")


def test_a_block_without_ctrl_c_ends_quietly_and_its_errors_pass_through() -> None:
    with interrupts_held():
        pass
    with pytest.raises(ValueError, match="boom"), interrupts_held():
        raise ValueError("boom")


def test_outside_the_main_thread_the_block_just_runs() -> None:
    ran: list[bool] = []

    def body() -> None:
        with interrupts_held():
            ran.append(True)

    t = threading.Thread(target=body)
    t.start()
    t.join(5)
    assert ran == [True]
