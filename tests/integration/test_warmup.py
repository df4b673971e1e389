"""The warm-up against a real server on loopback that holds up one of its answers, as a shared host
holds up a card's request now and then: the speed it teaches is the card's own."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from taogate.control.warmup import Warmup
from taogate.dispatch.speed import SpeedEstimator
from taogate.emulator.config import EmulatorConfig, Faults
from taogate.emulator.fleet import run_fleet
from taogate.fleet.instance import Instance, InstanceSpec
from taogate.gateway import Gateway
from taogate.serving import serve_asgi
from taogate.settings import Settings
from tests.conftest import ENV

FIXED = 0.02  # seconds every answer takes
PER_WORD = 1e-4  # seconds of prefill per word: 10,000 words/s, one token per word
HELD_UP = 0.4  # the held-up answer's extra wait
WORDS = 2000


def _card(prompts: list[int], held: int) -> Starlette:
    async def completions(request: Request) -> Response:
        words = len(orjson.loads(await request.body())["prompt"].split())
        await asyncio.sleep(FIXED + words * PER_WORD + (HELD_UP if len(prompts) == held else 0.0))
        prompts.append(words)
        return Response(orjson.dumps({"usage": {"prompt_tokens": words}}), media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.parametrize("held", [0, 1], ids=["tiny-answer-held-up", "large-answer-held-up"])
async def test_a_held_up_answer_does_not_misjudge_the_card(held: int) -> None:
    prompts: list[int] = []
    settings = Settings(dispatch={"warmup_tokens": WORDS})
    speeds = SpeedEstimator()
    async with serve_asgi(_card(prompts, held)) as served, httpx.AsyncClient(trust_env=False) as client:
        inst = Instance(
            InstanceSpec("card", served.url),
            unhealthy_after=2,
            healthy_after=1,
            breaker_failures=3,
            breaker_cooldown=1.0,
        )
        inst.models = frozenset({"m"})
        started = time.monotonic()
        await Warmup(client, speeds, lambda: settings)(inst)
        took = time.monotonic() - started
    # A tiny and a large prompt, twice (salt and "warm-up" add a word or two to each).
    assert len(prompts) == 4 and prompts[0] == prompts[2] < 16 and prompts[1] == prompts[3] > WORDS, prompts
    # The card prefills 10,000 words/s. Taught by a held-up tiny answer it would look four times that
    # (a prefill time floored at a quarter of the large answer's); by a held-up large one, a third.
    assert 0.7 / PER_WORD < speeds.speed("card") < 1.4 / PER_WORD, (speeds.speed("card"), took)


async def test_a_name_re_pointed_while_its_old_server_warms_up_is_warmed_at_its_new_one() -> None:
    """Warm-ups ran one per name: the new server's was skipped while the old one's ran, and the
    old one's, retired, taught nothing; the instance served unwarmed."""

    def config(url: str) -> Settings:
        dispatch = {"warmup_tokens": 1024, "health_check_interval": 3600, "scrape_interval": 0}
        return Settings(instances=[{"url": url, "name": "a"}], dispatch=dispatch)  # type: ignore[list-item,arg-type]

    slow = EmulatorConfig(faults=Faults(slow_first_byte=0.5))  # four prompts: 2 s
    async with run_fleet([slow, EmulatorConfig()]) as fleet:
        old_url, new_url = fleet.urls
        gw = Gateway(config(old_url), environ=ENV)
        try:
            await gw.probes.probe_all()  # up: the old server's warm-up starts
            gw.reload(config(new_url))
            await gw.probes.probe_all()
            assert gw.fleet.get("a").up
            assert await gw.probes.warmed(within=10) == []
            assert gw.speeds.samples("a") > 0
        finally:
            await gw.stop()
