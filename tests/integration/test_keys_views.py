"""The client keys where an operator looks: the keys table of the fleet page (a real headless
Chromium) and of ``taogate status``, from a gateway with named keys on loopback."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from rich.console import Console

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.observe.console import status_view
from tests.conftest import KEY, missing
from tests.integration.keys_helpers import SECRETS, chat_once, keyed_gateway, keyed_settings
from tests.integration.test_fleet_page import CHROMIUM_FLAGS, _chromium, wait_for_count

pytestmark = [pytest.mark.timeout(180)]

KEYS = [
    {"name": "team-a", "key_env": "TEAM_A_KEY", "requests_per_minute": 2, "max_concurrency": 4},
    {"name": "team-b", "key_env": "TEAM_B_KEY", "tokens_per_minute": 10_000},
]


async def test_the_keys_table_on_the_fleet_page_and_in_status() -> None:
    chromium = _chromium()
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        missing("playwright", hint="pip install -c constraints.txt -e '.[test]'")
    async with (
        run_fleet([EmulatorConfig(seed=0)]) as fleet,
        keyed_gateway(keyed_settings(fleet.urls, KEYS)) as gw,
    ):
        for _ in range(2):
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
        with pytest.raises(openai.RateLimitError):
            await chat_once(gw, SECRETS["TEAM_A_KEY"])
        await chat_once(gw, SECRETS["TEAM_B_KEY"])
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
            data = (await http.get(gw.url + "/admin/instances")).json()
        console = Console(width=160, record=True)
        console.print(status_view(data, gw.url, 160))
        text = console.export_text()
        assert "client keys" in text
        team_a = next(line for line in text.splitlines() if "team-a" in line)
        assert "2 / 2" in team_a and "0 / 4" in team_a and "1 requests" in team_a

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = await browser.new_page()
                problems: list[str] = []
                page.on("pageerror", lambda e: problems.append(str(e)))
                await page.goto(gw.url + "/dashboard")
                await page.get_by_label("Admin key", exact=True).fill(KEY)
                await page.get_by_role("button", name="Connect").click()
                await wait_for_count(page, "#key-rows tr", 3)
                assert await page.locator("#keys-section").is_visible()
                row = await page.locator("#key-rows tr[data-key=team-a]").inner_text()
                assert "2 / 2" in row and "1 requests" in row, row
                row_b = await page.locator("#key-rows tr[data-key=team-b]").inner_text()
                assert "/ 10000" in row_b, row_b
                await asyncio.sleep(0)
                assert problems == [], problems
            finally:
                await browser.close()
