"""The naming rule bench and diagnose share with the gateway, the held gateway logs, and the demo's
explanation of the max/mean rule."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console

from taogate.bench.demo import DEMO_SCENARIOS, Answer, rule_line
from taogate.bench.notes import held_logs
from taogate.bench.report import instance_labels
from taogate.instance_settings import instance_label


def test_an_instance_is_its_name_else_host_port() -> None:
    assert instance_label("http://10.0.0.7:8000", "gpu-a") == "gpu-a"
    assert instance_label("http://user:secret@10.0.0.7:8000/v1") == "10.0.0.7:8000"
    assert instance_label("http://[::1]:8001") == "[::1]:8001"


def test_a_url_given_twice_is_told_apart() -> None:
    urls = ["http://h:1", "http://h:2", "http://h:1", "http://h:1"]
    assert instance_labels(urls) == ["h:1", "h:2", "h:1#2", "h:1#3"]


def test_held_logs_are_said_once_per_kind_after_the_runs() -> None:
    log = logging.getLogger("taogate.health")
    out = Console(record=True, width=200)
    with held_logs() as held:
        for name in ("i0", "i1", "i2"):
            log.warning("instance %s: a scrape took %.2f s", name, 0.23)
        log.warning("instance %s is slow: %.2fx", "i3", 0.34)
        log.warning("instance %s is slow: %.2fx", "i3", 0.45)
        log.info("not held: below warning")
        assert out.export_text() == ""  # nothing printed while the runs go
        held.flush_to(out)
    text = out.export_text()
    assert "instance i0: a scrape took 0.23 s (2 more like it)" in text
    assert "instance i3 is slow: 0.34x (1 more like it)" in text
    assert text.count("\n") == 3
    assert not held.lines()  # flushed
    assert logging.getLogger("taogate").propagate  # restored


def answer(seconds: float, instance: str) -> Answer:
    return Answer(seconds, 200, instance, 4100)


def test_the_demo_says_why_its_own_fleet_is_over_the_max_mean_rule() -> None:
    fast = [answer(0.45, f"i{n % 3}") for n in range(60)]
    slow = [answer(1.4, "i3") for _ in range(4)]
    line = rule_line(fast + slow, "i3", 16)
    assert "over the article's max/mean ≤ 2 rule, as it should be on this fleet" in line
    assert "i3 is the 2.5x slow card" in line and "4 of 64" in line and "max/mean 1.00 without them" in line
    assert "first 16" not in line  # without the slow card the rest is within the rule
    warm = [answer(1.3, "i0"), *fast[1:], *slow]  # one of the first burst waited for a first prefill
    assert "the first 16, sent at once, also waited" in rule_line(warm, "i3", 16)
    assert "(after them, max/mean 1.00)" in rule_line(warm, "i3", 16)
    assert rule_line(fast, "i3", 16).endswith("within the article's max/mean ≤ 2 rule")


def test_every_demo_row_has_a_pooled_bound_with_its_own_caching() -> None:
    """A bound without the cache the row it bounds has is beaten by the cache, not by dispatch."""
    rows = {s.prefix_caching for s in DEMO_SCENARIOS if s.kind != "pooled"}
    bounds = {s.prefix_caching for s in DEMO_SCENARIOS if s.kind == "pooled"}
    assert rows == bounds == {False, True}


def test_instance_flags_keep_the_names_the_config_gives_them(tmp_path: Path) -> None:
    from taogate.bench.endpoint import _fleet

    config = tmp_path / "config.toml"
    instance = '[[instances]]\nurl = "http://10.0.0.1:8000"\nname = "gpu-a"\n'
    config.write_text("[dispatch]\nmax_queue_per_instance = 12\n" + instance)
    fleet, dispatch = _fleet(config, None, None)
    assert fleet == [("http://10.0.0.1:8000", "gpu-a")]
    assert dispatch is not None and dispatch.max_queue_per_instance == 12  # what diagnose's run A uses
    assert _fleet(None, None, ["http://10.0.0.1:8000"])[1] is None  # no file read: diagnose's defaults
    flags = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000", "http://10.0.0.1:8000"]
    assert _fleet(config, None, flags)[0] == [
        ("http://10.0.0.1:8000", "gpu-a"),
        ("http://10.0.0.2:8000", "10.0.0.2:8000"),
        ("http://10.0.0.1:8000", "10.0.0.1:8000#2"),
    ]
