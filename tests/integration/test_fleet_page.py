"""The fleet page in a real headless Chromium, against an emulated fleet with one slow card under load.

A person's view: the key goes into the page's own form, every instance has its row, the slow card is
marked slow in words, the figures move, drain and undrain work from the page, and the page fetches
nothing from anywhere but the gateway. The screenshot is saved in the test's directory; set
``TAOGATE_UPDATE_SCREENSHOT=1`` to write it over docs/dashboard.png as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from taogate.emulator.config import EmulatorConfig
from tests.conftest import KEY, Running, missing, running_gateway

MODEL = "emulated-model"
# Long names, as real fleets have them: the page must show each in full, in the table and the legends.
NAMES = [f"vllm-{c}.gpu-pool-eu-west-1.inference.example.internal:8000" for c in "abcd"]
SLOW = NAMES[2]
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
# Without the background-networking flags Chromium dials out on its own, which a closed network
# refuses (and which would show up as requests the page did not make).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def wait_for_count(page: Any, selector: str, count: int) -> None:
    """Until ``selector`` matches ``count`` elements. Playwright's own assertion, which polls from its
    injected script: ``wait_for_function`` with a string evaluates it, which the page's CSP (no
    ``unsafe-eval``) refuses once the first look does not already pass."""
    from playwright.async_api import expect

    await expect(page.locator(selector)).to_have_count(count, timeout=30_000)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("chromium", hint="apt-get install chromium")
    return path


def _fleet() -> list[EmulatorConfig]:
    base: dict[str, Any] = {
        "prefill_tokens_per_s": 8_000.0,
        "step_overhead": 0.004,
        "max_num_batched_tokens": 4096,
    }
    return [
        EmulatorConfig(seed=i, slowdown=3.0 if NAMES[i] == SLOW else 1.0, enable_prefix_caching=True, **base)
        for i in range(4)
    ]


async def _load(gw: Running, stop: asyncio.Event, concurrency: int) -> None:
    """Unique ~1,500-token prompts, up to ``concurrency`` at a time, until ``stop`` (and at most
    2,000 per worker)."""

    loop = asyncio.get_running_loop()

    async def worker(h: httpx.AsyncClient, w: int) -> None:
        i = 0
        while not stop.is_set() and i < 2_000:
            i += 1
            if w >= 6 and int(loop.time() / 8) % 2:  # a tide, so that the charts have a shape
                await asyncio.sleep(0.5)
                continue
            body = {
                "model": MODEL,
                "prompt": f"worker {w} request {i} " + "alpha beta gamma delta " * 375,
                "max_tokens": 8,
            }
            r = await h.post(gw.api_base + "/completions", json=body)
            assert r.status_code in (200, 429), r.text

    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as h:
        await asyncio.gather(*(worker(h, w) for w in range(concurrency)))


@contextlib.asynccontextmanager
async def _loaded(gw: Running, concurrency: int) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(_load(gw, stop, concurrency))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_the_dashboard_in_a_real_browser(tmp_path: Path) -> None:
    chromium = _chromium()
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        missing("playwright", hint="pip install -c constraints.txt -e '.[test]'")
    # A small cap makes the fast cards fill, so the slow one gets work (and evidence) and the
    # gateway queue holds something.
    async with (
        running_gateway(_fleet(), names=NAMES, dispatch={"max_queue_per_instance": 2, "queue_size": 4}) as gw,
        _loaded(gw, concurrency=10),
        async_playwright() as pw,
    ):
        requests: list[str] = []
        problems: list[str] = []
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1440, "height": 800},
        )
        try:
            context.on("request", lambda r: requests.append(r.url))
            page = await context.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("dialog", lambda d: asyncio.ensure_future(d.accept()))

            response = await page.goto(gw.url + "/dashboard")
            assert response is not None and response.status == 200
            headers = response.headers
            csp = headers["content-security-policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp
            assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
            assert headers["x-content-type-options"] == "nosniff"
            assert headers["referrer-policy"] == "no-referrer"

            # The page itself carries no data: it asks for the key first.
            assert await page.locator("#board").is_hidden()
            await page.get_by_label("Admin key", exact=True).fill(KEY)
            await page.get_by_role("button", name="Connect").click()

            rows = page.locator("#rows tr")
            await wait_for_count(page, "#rows tr", 4)
            names = [await rows.nth(i).get_attribute("data-instance") for i in range(4)]
            assert sorted(names) == NAMES  # type: ignore[type-var]
            header_cells = await page.locator("#instances thead th[scope=col]").all_inner_texts()
            assert "verdict" in header_cells and "TTFT p50 / p99" in header_cells

            # The slow card is marked slow, in words, and only it.
            slow_row = page.locator(f'#rows tr[data-instance="{SLOW}"]')
            await page.wait_for_selector(
                f'#rows tr[data-instance="{SLOW}"][data-state=slow]', timeout=120_000
            )
            assert "slow" in (await slow_row.locator("td.verdict").inner_text()).lower()
            states = {
                n: await page.locator(f'#rows tr[data-instance="{n}"]').get_attribute("data-state")
                for n in names
            }
            assert [n for n, s in states.items() if s == "slow"] == [SLOW], states
            # Every row shows the decode pace dispatch prices an output token at, in milliseconds.
            paces = await page.locator("#rows td[data-column=decode]").all_inner_texts()
            assert len(paces) == 4 and all(float(p) > 0 for p in paces), paces
            # Long names wrap at their dots: the table stays within the window, nothing scrolls sideways.
            widths = await page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
            assert widths[0] <= widths[1], widths

            # Figures change between two looks.
            first = await page.locator("#instances tbody").inner_text()
            first_chart = await page.locator("#c-rps path").first.get_attribute("d")
            await asyncio.sleep(2.5)
            second = await page.locator("#instances tbody").inner_text()
            second_chart = await page.locator("#c-rps path").first.get_attribute("d")
            assert first != second and first_chart != second_chart
            assert await page.locator("#c-inflight path.series").count() == 4
            # Every chart's legend names every instance in full, uncut, and marks the slow one.
            for chart in ("c-inflight", "c-ttft", "c-rps"):
                await wait_for_count(page, f"#{chart}-legend li", 4)
                assert await page.locator(f"#{chart}-legend li.slow").text_content() == f"{SLOW} (slow)"
                # One look inside the page: the page redraws its legends every second, so items
                # found first and measured in a second call may be gone by then.
                shown = await page.evaluate(
                    f"() => [...document.querySelectorAll('#{chart}-legend li')].map(li =>"
                    " [li.textContent, li.scrollWidth <= li.clientWidth,"
                    " li.getBoundingClientRect().right"
                    " <= li.closest('figure').getBoundingClientRect().right])",
                )
                assert sorted(t.removesuffix(" (slow)") for t, _, _ in shown) == NAMES, shown
                assert all(fits and inside for _, fits, inside in shown), shown

            await asyncio.sleep(6)  # a little more history on the charts for the picture
            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("TAOGATE_UPDATE_SCREENSHOT"):
                SCREENSHOT.parent.mkdir(exist_ok=True)
                shutil.copyfile(shot, SCREENSHOT)

            # Drain from the page (a confirmed action), then undrain.
            drained = NAMES[1]
            target = gw.app.gateway.fleet.get(drained)
            await page.get_by_role("button", name=f"Drain {drained}").click()
            await page.wait_for_selector(f'#rows tr[data-instance="{drained}"][data-state=draining]')
            assert target.draining
            await page.get_by_role("button", name=f"Undrain {drained}").click()
            await page.wait_for_selector(f'#rows tr[data-instance="{drained}"]:not([data-state=draining])')
            assert not target.draining

            # The key lives in the tab's session storage: never in a URL, never in a cookie.
            stored = await page.evaluate("sessionStorage.getItem('taogate.adminKey')")
            assert stored == KEY
            assert await context.cookies() == []
        finally:
            await context.close()
    outside = [u for u in requests if not u.startswith(gw.url + "/")]
    assert outside == [], outside
    assert not [u for u in requests if KEY in u]
    assert any(u.endswith("/admin/history") or "/admin/history?since=" in u for u in requests)
    assert problems == [], problems
