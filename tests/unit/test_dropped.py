"""``DroppedResponses``: one server complaint hidden per deliberate drop, and nothing else."""

from __future__ import annotations

import logging

from taogate.observe.dropped import INCOMPLETE_RESPONSE, DroppedResponses


def record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, None, None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_hidden_per_expected_drop() -> None:
    f = DroppedResponses(clock=Clock())
    assert f.filter(record(INCOMPLETE_RESPONSE))  # nothing expected: a bug of ours, shown
    f.expect()
    f.expect()
    assert not f.filter(record(INCOMPLETE_RESPONSE))
    assert not f.filter(record(INCOMPLETE_RESPONSE))
    assert f.filter(record(INCOMPLETE_RESPONSE))


def test_other_lines_pass_and_do_not_use_up_an_expectation() -> None:
    f = DroppedResponses(clock=Clock())
    f.expect()
    assert f.filter(record("Exception in ASGI application"))
    assert not f.filter(record(INCOMPLETE_RESPONSE))


def test_an_expectation_expires() -> None:
    clock = Clock()
    f = DroppedResponses(window=5.0, clock=clock)
    f.expect()  # e.g. the client hung up meanwhile, so the server had nothing to complain about
    clock.now += 6.0
    assert f.filter(record(INCOMPLETE_RESPONSE))


def test_expired_expectations_go_even_if_no_line_ever_comes() -> None:
    """Drops the server never complains of (the client gone too; picker mode) keep nothing."""
    clock = Clock()
    f = DroppedResponses(window=5.0, clock=clock)
    for _ in range(1000):
        f.expect()
        clock.now += 1.0
    assert len(f) <= 6


def test_as_a_logger_filter() -> None:
    logger = logging.getLogger("test_dropped.server")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            seen.append(rec.getMessage())

    handler, f = Keep(), DroppedResponses()
    logger.addHandler(handler)
    logger.addFilter(f)
    logger.propagate = False
    try:
        f.expect()
        logger.error(INCOMPLETE_RESPONSE)
        logger.error(INCOMPLETE_RESPONSE)
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(f)
    assert seen == [INCOMPLETE_RESPONSE]
