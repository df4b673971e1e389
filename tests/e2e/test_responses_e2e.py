"""Stored Responses through the gateway: every request about a response reaches the instance that
holds it (the real OpenAI SDK, emulators with vLLM's per-process store)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.proxy.responses import token
from tests.conftest import KEY, GatewayFactory, Running, gateway_settings

MODEL = "emulated-model"
STORED = [EmulatorConfig(seed=i, responses_store=True) for i in range(2)]
AUTH = {"authorization": f"Bearer {KEY}"}


def sdk(gw: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.api_base, api_key=KEY, max_retries=0, timeout=30)


async def chain(client: openai.AsyncOpenAI, turns: int, **first: str) -> list[tuple[str, str]]:
    """``turns`` requests, each continuing the last: (response id, instance that served it)."""
    served: list[tuple[str, str]] = []
    previous: str | None = None
    for turn in range(turns):
        extra = first if turn == 0 else {}
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input=f"turn {turn}", max_output_tokens=4, previous_response_id=previous, **extra
        )
        reply = raw.parse()
        assert reply.output_text and reply.status == "incomplete"  # cut at max_output_tokens, as vLLM says
        assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"
        previous = reply.id
        served.append((reply.id, raw.headers["x-taogate-instance"]))
    return served


async def test_six_chained_calls_across_two_instances_all_succeed(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(STORED) as gw, sdk(gw) as client:
        chains = await asyncio.gather(*(chain(client, 6) for _ in range(4)))
        origins = {c[0][1] for c in chains}
        assert origins == {"i0", "i1"}, "dispatch spreads new conversations over both instances"
        for served in chains:
            assert len({instance for _, instance in served}) == 1  # each turn where its history is
            assert all(rid.startswith(f"resp_{token(served[0][1])}_") for rid, _ in served)
        # The conversation really continued: the instance saw each turn's history.
        last = chains[0][-1][0]
        stored = await client.responses.retrieve(last)
        assert stored.id == last and stored.usage is not None and stored.usage.input_tokens > 20
        streamed = await client.responses.create(
            model=MODEL, input="and?", max_output_tokens=3, previous_response_id=last, stream=True
        )
        events = [event async for event in streamed]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        # One message, one id: in the events that name it and in the response they complete.
        done = events[-1].response  # type: ignore[union-attr]
        named = {e.item_id for e in events if hasattr(e, "item_id")}
        named |= {e.item.id for e in events if e.type.startswith("response.output_item")}  # type: ignore[union-attr]
        assert named == {done.output[0].id}, (named, done.output[0].id)


async def test_an_id_the_client_chose_is_remembered(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(STORED) as gw, sdk(gw) as client:
        served = await chain(client, 3, extra_body={"request_id": "resp_chosen-by-client"})  # type: ignore[arg-type]
        assert served[0][0] == "resp_chosen-by-client"
        assert len({instance for _, instance in served}) == 1
        retrieved = await client.responses.retrieve("resp_chosen-by-client")
        assert retrieved.id == "resp_chosen-by-client"


async def test_get_cancel_and_delete_reach_the_owner_and_its_answer_is_relayed(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(STORED) as gw, sdk(gw) as client, httpx.AsyncClient(timeout=30) as http:
        (rid, owner), *_ = await chain(client, 1)
        for _ in range(4):  # never a miss on the other instance
            got = await http.get(f"{gw.url}/api/v1/responses/{rid}", headers=AUTH)
            assert got.status_code == 200 and got.headers["x-taogate-instance"] == owner
        encoded = await http.get(f"{gw.url}/v1/%72esponses/{rid}", headers=AUTH)  # routed decoded
        assert encoded.status_code == 200 and encoded.headers["x-taogate-instance"] == owner
        assert encoded.json()["id"] == rid
        cancel = await http.post(f"{gw.url}/v1/responses/{rid}/cancel", headers=AUTH)
        assert cancel.status_code == 400 and cancel.headers["x-taogate-instance"] == owner
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
        deleted = await http.delete(f"{gw.url}/v1/responses/{rid}", headers=AUTH)
        assert deleted.status_code == 405 and deleted.headers["x-taogate-instance"] == owner  # vLLM 0.32
        unknown = await http.get(f"{gw.url}/v1/responses/resp_0123456789abcdef", headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"


async def test_a_response_whose_instance_left_gets_vllm_s_not_found(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(STORED) as gw, sdk(gw) as client, httpx.AsyncClient(timeout=30) as http:
        (rid, owner), *_ = await chain(client, 1)
        left = [u for u, name in zip(gw.fleet.urls, ("i0", "i1"), strict=True) if name != owner]
        gw.gateway.reload(gateway_settings(left, names=["i0" if owner == "i1" else "i1"]))
        expected = {
            "error": {
                "message": f"Response with id '{rid}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        got = await http.get(f"{gw.url}/v1/responses/{rid}", headers=AUTH)
        assert got.status_code == 404 and got.json() == expected
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model=MODEL, input="more", previous_response_id=rid)
        assert missing.value.body == expected["error"]


async def test_a_responses_stream_broken_mid_way_ends_with_the_responses_error_event(
    gateway_factory: GatewayFactory,
) -> None:
    """A Responses stream ends as the API's do: an ``error`` event (typed for a client that
    dispatches on events, no ``[DONE]``), on which the OpenAI SDK raises its APIError."""
    async with gateway_factory(STORED) as gw, sdk(gw) as client:
        for inst in gw.fleet.instances:
            inst.faults.close_mid_stream = 3
        events: list[str] = []
        with pytest.raises(openai.APIError, match="broke the stream"):
            stream = await client.responses.create(model=MODEL, input="hi", max_output_tokens=20, stream=True)
            async for event in stream:
                events.append(event.type)
        assert events and events[0] == "response.created"
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream(
                "POST",
                f"{gw.url}/v1/responses",
                headers=AUTH,
                json={"model": MODEL, "input": "hi", "max_output_tokens": 20, "stream": True},
            ) as raw,
        ):
            data = b"".join([chunk async for chunk in raw.aiter_bytes()])
        assert data.endswith(b"\n\n") and b"[DONE]" not in data
        last = data.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b'event: error\ndata: {"type":"error","code":"upstream_stream_broken"'), last
