"""Non-streaming answers bring the engine's load back (endpoint-load-metrics): dispatch sees it at
once, even with engine scrapes off."""

from __future__ import annotations

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet

from .dispatch_helpers import client, complete, serve_gateway, settings_for


async def test_a_non_stream_answer_refreshes_the_engine_view() -> None:
    async with run_fleet([EmulatorConfig()]) as fleet:
        settings = settings_for(fleet.urls, names=["i0"], dispatch={"scrape_interval": 0})
        async with serve_gateway(settings) as gate, client() as http:
            inst = gate.gateway.fleet.get("i0")
            now = gate.gateway.clock()
            assert inst.view(now, 1.0, 3.0).engine is None  # never scraped
            reply = await complete(http, gate, "Hello there", max_tokens=2)
            assert reply.status_code == 200
            view = inst.view(gate.gateway.clock(), 1.0, 3.0)
            assert view.engine is not None and view.engine.waiting == 0.0 and view.engine.kv_usage == 0.0
            # The gateway asked, not the client: an instance's queue and KV usage stay the gateway's.
            assert "endpoint-load-metrics" not in reply.headers
            asked = await complete(
                http, gate, "Hello there", max_tokens=2, headers={"endpoint-load-metrics-format": "TEXT"}
            )
            assert asked.headers["endpoint-load-metrics"].startswith("TEXT ")
            streamed = await complete(http, gate, "Hello there", max_tokens=2, stream=True)
            assert "endpoint-load-metrics" not in streamed.headers
