"""Which build runs is said the same way in the log line, in /metrics and to the test run."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from taogate import __version__
from taogate.build import BUILD, build_of
from taogate.observe.metrics import GatewayMetrics
from tests.conftest import COMPILED


def test_the_build_is_the_one_these_tests_import() -> None:
    expected = "compiled" if COMPILED else "python"
    assert expected == BUILD


def test_a_module_the_wheel_never_compiles_or_that_is_missing_reads_as_python() -> None:
    assert build_of("taogate.cli") == "python"
    assert build_of("taogate.no_such_module") == "python"


def test_metrics_carry_the_version_and_the_build() -> None:
    text = generate_latest(GatewayMetrics(CollectorRegistry()).registry).decode()
    assert f'taogate_build_info{{request_path="{BUILD}",version="{__version__}"}} 1.0' in text
