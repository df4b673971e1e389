"""The fleet page in a real headless Chromium says, per instance, what precise dispatch runs on:
the KV-event index (an engine started first, recovered through its replay socket) or the model,
and why (one started first without a replay socket: its start was missed)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from taogate.emulator.fleet import run_fleet
from tests.conftest import KEY, missing, wait_until

from .test_fleet_page import CHROMIUM_FLAGS, _chromium, wait_for_count
from .test_kv_events_start import PREFIX, _configs, _direct, _gateway

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_the_page_says_what_dispatch_runs_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    chromium = _chromium()
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        missing("playwright", hint="pip install -c constraints.txt -e '.[test]'")
    caplog.set_level(logging.INFO, "taogate.health")
    configs = _configs(replay=True)
    configs[1] = replace(configs[1], kv_events_replay=None)  # i1 offers no replay socket
    async with run_fleet(configs) as fleet:
        for url in fleet.urls:
            await _direct(url, [*PREFIX, 7])  # both busy before the gateway
        async with (
            _gateway(fleet, configs, tmp_path, replay=True, warmup=64) as gate,
            async_playwright() as pw,
        ):
            caches = [gate.gateway.fleet.get(n).cache for n in ("i0", "i1")]
            await wait_until(
                lambda: (
                    caches[0].index is not None
                    and caches[0].index.trusted
                    and caches[1].index is not None
                    and caches[1].index.trust.reason == "missed_start"
                ),
                within=10.0,
                what="one recovered, one missed",
            )
            context = await pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
            )
            try:
                page = await context.new_page()
                await page.goto(gate.url + "/dashboard")
                await page.get_by_label("Admin key", exact=True).fill(KEY)
                await page.get_by_role("button", name="Connect").click()
                await wait_for_count(page, "#rows tr", 2)
                cells = {
                    name: await page.locator(
                        f"#rows tr[data-instance={name}] td[data-column=prefix-hits]"
                    ).inner_text()
                    for name in ("i0", "i1")
                }
            finally:
                await context.close()
    assert cells["i0"].endswith("by index"), cells
    assert cells["i1"].endswith("by model (missed start)"), cells
