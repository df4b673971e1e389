"""Hostile Responses clients: ids chosen to cost memory, and ids chosen to take over another client's
stored response. Two emulators that keep responses, as vLLM does with its store on."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from taogate.emulator.config import EmulatorConfig
from tests.hostile.helpers import AUTH, MODEL, beside, gateway, in_thread

pytestmark = pytest.mark.timeout(90)

MAX_ID_BYTES = 256  # the longest id a client may choose
STORE = EmulatorConfig(instant=True, responses_store=True)


def _create(url: str, fields: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 2, **fields}
    with httpx.Client(headers=AUTH, timeout=20) as client:
        return client.post(url + "/v1/responses", json=body)


def _get(url: str, response_id: str) -> httpx.Response:
    with httpx.Client(headers=AUTH, timeout=20) as client:
        return client.get(f"{url}/v1/responses/{response_id}")


async def test_a_long_chosen_id_is_a_clear_400_and_costs_no_memory() -> None:
    async with gateway(emulator=STORE) as (gw, _), beside(gw):
        for _ in range(40):
            r = await in_thread(_create, gw.url, {"request_id": "r" * (1 << 20)})
            assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request_id", "request_id")
        ok = await in_thread(_create, gw.url, {"request_id": "a" * MAX_ID_BYTES})
        assert ok.status_code == 200, ok.text[:300]
        ids = gw.gateway.pipeline.responses
        assert (len(ids), ids.bytes) == (1, MAX_ID_BYTES)


async def test_an_id_bound_to_one_instance_cannot_be_re_pointed_by_another_client() -> None:
    async with gateway(emulators=2, emulator=STORE) as (gw, _), beside(gw):
        # client A stores its response under a name of its own choosing
        mine = await in_thread(_create, gw.url, {"request_id": "victim-conv-7", "input": "A's secret"})
        assert mine.status_code == 200, mine.text
        home = mine.headers["x-taogate-instance"]
        # client B gets a response of its own on the other instance ...
        for i in range(40):
            other = await in_thread(_create, gw.url, {"input": f"B's question {i}"})
            if other.headers["x-taogate-instance"] != home:
                break
        else:
            pytest.fail("every response landed on one instance")
        # ... and continues it under A's id: it is served there, but the name stays A's
        hijack = await in_thread(
            _create, gw.url, {"request_id": "victim-conv-7", "previous_response_id": other.json()["id"]}
        )
        assert hijack.status_code == 200, hijack.text
        assert hijack.headers["x-taogate-instance"] != home
        again = await in_thread(_get, gw.url, "victim-conv-7")
    assert again.status_code == 200, again.text
    assert again.headers["x-taogate-instance"] == home
    assert again.json()["previous_response_id"] is None  # A's own, not B's continuation
