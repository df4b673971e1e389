"""The Inference Extension's objective header read as a priority class (pure, no I/O)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taogate.picker.names import OBJECTIVE
from taogate.picker.objective import Objectives, objective_class
from taogate.proxy.priority import HEADER
from taogate.settings import ConfigError, Settings

TABLE = {"critical": 10, "batch": -5, "standard": 0}


def test_an_objective_is_the_negative_of_its_priority() -> None:
    assert objective_class(b"critical", TABLE) == -10  # served before the default class 0
    assert objective_class(b"batch", TABLE) == 5
    assert objective_class(b"standard", TABLE) == 0
    assert objective_class(b"unknown", TABLE) is None
    assert objective_class(None, TABLE) is None
    assert objective_class(b"critical", {}) is None


@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True), st.integers(-1000, 1000)))
def test_a_higher_priority_is_never_a_later_class(table: dict[str, int]) -> None:
    for a, pa in table.items():
        for b, pb in table.items():
            if pa > pb:
                ca, cb = objective_class(a.encode(), table), objective_class(b.encode(), table)
                assert ca is not None and cb is not None and ca < cb


def test_the_objective_stands_in_for_the_clients_own_claim() -> None:
    headers = [(b"content-type", b"application/json"), (HEADER, b"-99"), (OBJECTIVE[0], b"batch")]
    out, sheddable = Objectives().read(headers, TABLE)
    assert [v for k, v in out if k == HEADER] == [b"5"]
    assert (b"content-type", b"application/json") in out
    assert sheddable  # a negative priority, as the Inference Extension has it


@pytest.mark.parametrize(
    ("name", "sheddable"), [(b"critical", False), (b"standard", False), (b"batch", True)]
)
def test_only_a_negative_priority_is_sheddable(name: bytes, sheddable: bool) -> None:
    assert Objectives().read([(OBJECTIVE[0], name)], TABLE)[1] is sheddable
    assert Objectives().read([(HEADER, b"7")], TABLE)[1] is False  # a class claimed is no objective


def test_an_unknown_objective_is_said_once_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    objectives = Objectives()
    headers = [(HEADER, b"-1"), (OBJECTIVE[0], b"gold")]
    with caplog.at_level(logging.WARNING, logger="taogate.picker"):
        for _ in range(3):
            assert objectives.read(headers, TABLE) == (headers, False)
        for i in range(200):  # a client's endless names: said for the first few only, cut short
            objectives.read([(OBJECTIVE[0], f"name-{i}-".encode() * 1000)], TABLE)
    said = [r.getMessage() for r in caplog.records]
    assert sum("'gold' is not in [picker] objectives" in m for m in said) == 1
    assert len(said) == 64
    assert max(len(n) for n in objectives._unknown) == 253
    assert objectives.read([(b"x-other", b"1")], TABLE) == ([(b"x-other", b"1")], False)


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"Gold_Tier": 1}, "is not an InferenceObjective name"),
        ({"gold": 2**31}, "outside a 32-bit priority"),
    ],
)
def test_the_config_names_a_bad_objective(table: dict[str, int], says: str) -> None:
    with pytest.raises((ValueError, ConfigError), match=says):
        Settings(picker={"objectives": table})


def test_llm_ds_names_for_the_objective_are_read_too_the_inference_extensions_first() -> None:
    for name in (b"x-llm-d-router-inference-objective", b"x-llm-d-inference-objective"):
        headers, sheddable = Objectives().read([(name, b"batch")], TABLE)
        assert (HEADER, b"5") in headers and sheddable
    both = [(b"x-llm-d-inference-objective", b"batch"), (OBJECTIVE[0], b"critical")]
    headers, sheddable = Objectives().read(both, TABLE)
    assert (HEADER, b"-10") in headers and not sheddable
