"""The ext_proc protocol as a gateway speaks it, message by message, over real gRPC to an in-process
picker in front of emulated instances: the held pick, the body handed back in chunks, the served
endpoint moving the lease, a stream closed without a response, the health services."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.picker.encoding import CHUNK
from taogate.picker.hints import endpoint_of
from taogate.picker.names import DESTINATION, FAIRNESS_ID, MODEL_REWRITE, OBJECTIVE
from taogate.picker.server import HEALTH_SERVICES, RunningPicker, serve_picker
from tests.conftest import ENV, KEY, gateway_settings, wait_until


def _headers(pairs: Sequence[tuple[str, str]], end: bool = False) -> Any:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)


def _metadata(namespace: str, key: str, value: Any) -> Any:
    struct = struct_pb2.Struct()
    struct.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: struct})


def _request(path: str = "/v1/chat/completions", key: str = KEY) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":path", path),
        ("authorization", f"Bearer {key}"),
        ("content-type", "application/json"),
    ]


def _chat(content: str = "hi") -> bytes:
    return orjson.dumps(
        {"model": "emulated-model", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    )


class Conversation:
    """One ext_proc stream driven by hand: ``send`` a message, ``read`` the picker's answers."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.Process()

    async def send(self, **message: Any) -> None:
        await self.call.write(pb.ProcessingRequest(**message))

    async def read(self) -> Any:
        return await self.call.read()

    def cancel(self) -> None:
        self.call.cancel()


@pytest.fixture
async def picker() -> AsyncIterator[tuple[RunningPicker, Any]]:
    configs = [EmulatorConfig(seed=i) for i in range(2)]
    async with run_fleet(configs) as fleet:
        settings = gateway_settings(fleet.urls)
        async with (
            serve_picker(settings, environ=ENV) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            yield running, channel


#: The destination header the shipped Envoy bootstrap routes by.
PICK = DESTINATION[0]


def _set(answer: Any) -> dict[str, bytes]:
    return {h.header.key: h.header.raw_value for h in answer.header_mutation.set_headers}


async def test_pick_is_held_until_the_body_ends_and_the_served_endpoint_takes_the_lease(
    picker: tuple[RunningPicker, Any],
) -> None:
    running, channel = picker
    fleet = running.app.gateway.fleet
    talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
    await talk.send(request_headers=_headers(_request()))
    body = _chat("x" * (CHUNK + 1000))  # more than one chunk back
    await talk.send(request_body=pb.HttpBody(body=body[:100], end_of_stream=False))
    await talk.send(request_body=pb.HttpBody(body=body[100:], end_of_stream=True))
    answer = await talk.read()
    assert answer.WhichOneof("response") == "request_headers"
    common = answer.request_headers.response
    picked = _set(common)[PICK].decode()
    assert common.clear_route_cache
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    # Under the Inference Extension's name and llm-d's router's, header and metadata alike.
    assert [_set(common)[name].decode() for name in DESTINATION] == [picked, picked]
    assert [lb[name].string_value for name in DESTINATION] == [picked, picked]
    assert "authorization" in common.header_mutation.remove_headers  # the client's key stays here
    back = b""
    while True:
        chunk = (await talk.read()).request_body.response.body_mutation.streamed_response
        back += chunk.body
        if chunk.end_of_stream:
            break
    assert back == body
    by_host = {endpoint_of(i.spec.url): i for i in fleet}
    first = by_host[picked]
    other = next(i for i in fleet if i is not first)
    assert (first.inflight, other.inflight) == (1, 0)
    # The gateway says it served the request elsewhere (a fallback): the lease follows.
    served = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", endpoint_of(other.spec.url))
    status = [(":status", "200"), ("content-type", "application/json")]
    await talk.send(response_headers=_headers(status), metadata_context=served)
    told = _set((await talk.read()).response_headers.response)
    assert told["x-taogate-instance"] == other.name.encode()
    assert (first.inflight, other.inflight) == (0, 1)
    usage = orjson.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}})
    await talk.send(response_body=pb.HttpBody(body=usage, end_of_stream=True))
    echo = (await talk.read()).response_body.response.body_mutation.streamed_response
    assert echo.body == usage and echo.end_of_stream
    assert (first.inflight, other.inflight) == (0, 0)
    assert other.window.stats(running.app.gateway.clock()).requests == 1
    await talk.call.done_writing()


async def test_an_empty_body_phase_is_handed_back_so_the_request_ends(
    picker: tuple[RunningPicker, Any],
) -> None:
    """A request whose headers did not end the stream, then an empty last body chunk (HTTP/2's
    empty final frame): in full-duplex mode the body must come back, even empty, or the gateway
    never sees the request's end and the lease stays held."""
    running, channel = picker
    gateway = running.app.gateway
    item = gateway.pipeline.responses.mint(next(iter(gateway.fleet)).name)
    talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
    get = [(":method", "GET"), (":path", f"/v1/responses/{item}"), ("authorization", f"Bearer {KEY}")]
    await talk.send(request_headers=_headers(get))
    await talk.send(request_body=pb.HttpBody(body=b"", end_of_stream=True))
    assert (await talk.read()).WhichOneof("response") == "request_headers"
    back = (await asyncio.wait_for(talk.read(), 5)).request_body.response.body_mutation.streamed_response
    assert back.body == b"" and back.end_of_stream
    talk.cancel()
    await wait_until(lambda: sum(i.inflight for i in gateway.fleet) == 0, what="lease released")


async def test_a_stream_closed_without_a_response_gives_the_lease_back(
    picker: tuple[RunningPicker, Any],
) -> None:
    running, channel = picker
    fleet = running.app.gateway.fleet
    talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
    await talk.send(request_headers=_headers(_request()))
    await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
    await talk.read()
    assert sum(i.inflight for i in fleet) == 1
    talk.cancel()  # the gateway reset the request
    await wait_until(lambda: sum(i.inflight for i in fleet) == 0, what="lease released")


async def test_refusals_are_immediate_responses(picker: tuple[RunningPicker, Any]) -> None:
    _, channel = picker
    stub = pb_grpc.ExternalProcessorStub(channel)
    talk = Conversation(stub)
    await talk.send(request_headers=_headers(_request(key="wrong")))
    refused = (await talk.read()).immediate_response
    assert refused.status.code == 401
    assert orjson.loads(refused.body)["error"]["code"] == "invalid_api_key"
    talk = Conversation(stub)
    await talk.send(
        request_headers=_headers(_request()),
        metadata_context=_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", []),
    )
    await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
    empty = (await talk.read()).immediate_response
    assert empty.status.code == 503  # an empty subset: nothing may be picked
    talk = Conversation(stub)
    await talk.send(request_headers=_headers(_request("/v1/nothing-here"), end=True))
    assert (await talk.read()).immediate_response.status.code == 404


async def test_health_services_serve(picker: tuple[RunningPicker, Any]) -> None:
    _, channel = picker
    stub = health_pb2_grpc.HealthStub(channel)
    for name in HEALTH_SERVICES:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


async def test_a_request_whose_stream_closes_while_queued_leaves_the_queue() -> None:
    """Every instance at its cap: the pick waits in the gateway queue; the gateway resetting the
    stream takes it out, and it is accounted as a hang-up."""
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls, dispatch={"max_queue_per_instance": 1})
        async with (
            serve_picker(settings, environ=ENV) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            gateway = running.app.gateway
            stub = pb_grpc.ExternalProcessorStub(channel)
            first = Conversation(stub)
            await first.send(request_headers=_headers(_request()))
            await first.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            await first.read()
            second = Conversation(stub)
            await second.send(request_headers=_headers(_request()))
            await second.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            await wait_until(lambda: gateway.dispatcher.queued == 1, what="queued")
            gone = gateway.metrics.client_disconnects.labels().value
            second.cancel()
            await wait_until(lambda: gateway.dispatcher.queued == 0, what="left the queue")
            await wait_until(
                lambda: gateway.metrics.client_disconnects.labels().value == gone + 1, what="accounted"
            )
            first.cancel()
            await wait_until(lambda: sum(i.inflight for i in gateway.fleet) == 0, what="lease released")


async def test_without_the_key_check_the_gateway_authenticates() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls)
        async with (
            serve_picker(settings, environ=ENV, check_key=False) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            await talk.send(request_headers=_headers(_request(key="the-gateways-own")))
            await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            answer = (await talk.read()).request_headers.response
            assert PICK in _set(answer)
            assert "authorization" in answer.header_mutation.remove_headers  # still not passed on
            talk.cancel()


async def test_the_instance_is_told_its_own_key_and_the_response_names_it() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls)
        settings.instances[0].api_key_env = "INSTANCE_KEY"
        async with (
            serve_picker(settings, environ={**ENV, "INSTANCE_KEY": "instance-secret"}) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            await talk.send(request_headers=_headers([*_request(), ("x-api-key", KEY)]))
            await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            answer = (await talk.read()).request_headers.response
            assert _set(answer)["authorization"] == b"Bearer instance-secret"
            assert "x-api-key" in answer.header_mutation.remove_headers
            await talk.read()  # the body handed back
            status = [(":status", "200"), ("content-type", "application/json"), ("set-cookie", "a=b")]
            await talk.send(response_headers=_headers(status))
            told = (await talk.read()).response_headers.response
            assert _set(told)["x-taogate-instance"] == b"i0"
            assert "set-cookie" in told.header_mutation.remove_headers  # only the gateway speaks so
            talk.cancel()


async def test_named_keys_are_held_to_their_limits_as_under_serve() -> None:
    """A named key's concurrency slot is held until its response ends or its stream closes, its
    requests are counted per window, its models allow-listed; its responses carry x-ratelimit-*."""
    keys = [
        {"name": "team-a", "key_env": "TEAM_A_KEY", "requests_per_minute": 2, "max_concurrency": 1},
        {"name": "team-b", "key_env": "TEAM_B_KEY", "models": ["another-model"]},
    ]
    environ = {**ENV, "TEAM_A_KEY": "team-a-secret", "TEAM_B_KEY": "team-b-secret"}
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls)
        settings.keys = keys  # type: ignore[assignment]  # validated on assignment
        async with (
            serve_picker(settings, environ=environ) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            stub = pb_grpc.ExternalProcessorStub(channel)
            stats = running.app.gateway.limiter.stats

            async def ask(key: str) -> tuple[Conversation, Any]:
                talk = Conversation(stub)
                await talk.send(request_headers=_headers(_request(key=key)))
                await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
                return talk, await talk.read()

            first, picked = await ask("team-a-secret")
            assert PICK in _set(picked.request_headers.response)
            assert stats["team-a"].in_flight == 1
            _, busy = await ask("team-a-secret")  # its one slot is taken
            assert busy.immediate_response.status.code == 429
            await first.read()  # the body handed back
            await first.send(
                response_headers=_headers([(":status", "200"), ("content-type", "application/json")])
            )
            told = _set((await first.read()).response_headers.response)
            assert (told["x-ratelimit-limit-requests"], told["x-ratelimit-remaining-requests"]) == (
                b"2",
                b"1",
            )
            usage = orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            await first.send(response_body=pb.HttpBody(body=usage, end_of_stream=True))
            await first.read()
            assert (stats["team-a"].in_flight, stats["team-a"].completion_tokens) == (0, 2)

            second, _ = await ask("team-a-secret")
            second.cancel()  # the gateway reset the stream before any response: the slot comes back
            await wait_until(lambda: stats["team-a"].in_flight == 0, what="slot back")
            _, over = await ask("team-a-secret")  # the window's two: the first, the cancelled one
            refused = over.immediate_response
            assert refused.status.code == 429
            assert orjson.loads(refused.body)["error"]["code"] == "rate_limit_exceeded"
            assert any(h.header.key == "retry-after" for h in refused.headers.set_headers)
            _, barred = await ask("team-b-secret")
            assert barred.immediate_response.status.code == 404
            assert orjson.loads(barred.immediate_response.body)["error"]["code"] == "model_not_found"
            assert sum(i.inflight for i in running.app.gateway.fleet) == 0
            assert stats["team-a"].rejections == {"concurrency": 1, "requests": 1}


async def test_a_refusal_after_the_key_was_admitted_carries_its_rate_headers() -> None:
    """As under ``serve``: a request counted against its key's window and then refused (here no
    instance of the gateway's subset may take it) tells the client where its key stands."""
    keys = [{"name": "team-a", "key_env": "TEAM_A_KEY", "requests_per_minute": 5}]
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls)
        settings.keys = keys  # type: ignore[assignment]  # validated on assignment
        async with (
            serve_picker(settings, environ={**ENV, "TEAM_A_KEY": "team-a-secret"}) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            nowhere = _metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", [])
            await talk.send(request_headers=_headers(_request(key="team-a-secret")), metadata_context=nowhere)
            await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            refused = (await talk.read()).immediate_response
            assert refused.status.code == 503
            told = {h.header.key: h.header.raw_value for h in refused.headers.set_headers}
            told_limit = (told["x-ratelimit-limit-requests"], told["x-ratelimit-remaining-requests"])
            assert told_limit == (b"5", b"4")
            assert running.app.gateway.limiter.stats["team-a"].in_flight == 0


async def _answer(talk: Conversation) -> None:
    """The instance's whole answer, as the gateway relays it: the lease comes back."""
    await talk.send(response_headers=_headers([(":status", "200"), ("content-type", "application/json")]))
    await talk.read()
    await talk.send(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    await talk.read()


@pytest.mark.parametrize("check_key", [False, True])
async def test_behind_an_authenticating_gateway_its_flows_share_the_fleet(check_key: bool) -> None:
    """One slot; flow a holds it and queues two more, then flow b queues one. Where the gateway
    authenticates, its fairness id names the flows (a's under the Inference Extension's header, b's
    under llm-d's): b goes before a's second waiting request. Where taogate checks the key, a
    client's claim is no flow: first come, first served."""
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(fleet.urls, dispatch={"max_queue_per_instance": 1})
        async with (
            serve_picker(settings, environ=ENV, check_key=check_key) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            gateway = running.app.gateway
            stub = pb_grpc.ExternalProcessorStub(channel)
            talks: dict[str, Conversation] = {}
            picks: list[asyncio.Task[Any]] = []
            for name, flow in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
                talk = talks[name] = Conversation(stub)
                named = FAIRNESS_ID[0] if flow == "a" else b"x-llm-d-router-inference-fairness-id"
                await talk.send(request_headers=_headers([*_request(), (named.decode(), flow)]))
                await talk.send(request_body=pb.HttpBody(body=_chat(name * 50), end_of_stream=True))
                picks.append(asyncio.create_task(talk.read()))
                await wait_until(lambda: gateway.dispatcher.queued == len(talks) - 1, what="queued")
            order: list[str] = []
            for _ in range(4):
                waiting = [p for name, p in zip(talks, picks, strict=True) if name not in order]
                done, _ = await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
                assert len(done) == 1  # one slot: one pick at a time
                name = list(talks)[picks.index(done.pop())]
                order.append(name)
                await talks[name].read()  # the body handed back
                await _answer(talks[name])
            assert order == (["a1", "a2", "a3", "b1"] if check_key else ["a1", "a2", "b1", "a3"])
            assert ("flow:a" in gateway.dispatcher.fair._served) is not check_key


async def test_the_objective_a_request_names_sets_its_place_in_the_queue() -> None:
    """One slot, held; a request naming no objective waits, then a critical one, which goes first.
    A batch request (a negative priority: sheddable) is refused at once rather than queued. The
    priority instance is told each class."""
    objectives = {"critical": 10, "batch": -5}
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        settings = gateway_settings(
            fleet.urls,
            dispatch={"max_queue_per_instance": 1},
            limits={"max_priority": -10},
            picker={"objectives": objectives},
        )
        settings.instances[0].scheduling_policy = "priority"
        async with (
            serve_picker(settings, environ=ENV) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            gateway = running.app.gateway
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def ask(name: str, objective: str | None) -> Conversation:
                talk = Conversation(stub)
                named = [(OBJECTIVE[0].decode(), objective)] if objective else []
                await talk.send(request_headers=_headers([*_request(), *named]))
                await talk.send(request_body=pb.HttpBody(body=_chat(name * 50), end_of_stream=True))
                return talk

            talks: dict[str, Conversation] = {}
            picks: list[asyncio.Task[Any]] = []
            for name, objective in (("held", None), ("none", None), ("critical", "critical")):
                talks[name] = await ask(name, objective)
                picks.append(asyncio.create_task(talks[name].read()))
                await wait_until(lambda: gateway.dispatcher.queued == len(talks) - 1, what="queued")
            shed = (await (await ask("batch", "batch")).read()).immediate_response
            assert shed.status.code == 429
            assert orjson.loads(shed.body)["error"]["code"] == "shed"
            assert gateway.dispatcher.queued == 2
            order: list[str] = []
            told: dict[str, Any] = {}
            for _ in range(3):
                waiting = [p for name, p in zip(talks, picks, strict=True) if name not in order]
                done, _ = await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
                name = list(talks)[picks.index(done.pop())]
                order.append(name)
                handed = (await talks[name].read()).request_body.response.body_mutation.streamed_response
                told[name] = orjson.loads(handed.body).get("priority")
                await _answer(talks[name])
            assert order == ["held", "critical", "none"]
            assert told == {"held": None, "critical": -10, "none": None}


async def test_the_model_the_gateway_names_replaces_the_bodys() -> None:
    """A route's rewrite header sends the request to the instance serving that model, with the
    model written into the body; a malformed name is a 400 in OpenAI's shape."""
    configs = [EmulatorConfig(seed=0), EmulatorConfig(seed=1, model="canary-model")]
    async with run_fleet(configs) as fleet:
        settings = gateway_settings(fleet.urls)
        async with (
            serve_picker(settings, environ=ENV) as running,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel,
        ):
            fleet_state = running.app.gateway.fleet
            await wait_until(lambda: all(i.models for i in fleet_state), what="models learned")
            stub = pb_grpc.ExternalProcessorStub(channel)
            talk = Conversation(stub)
            await talk.send(
                request_headers=_headers([*_request(), (MODEL_REWRITE[0].decode(), "canary-model")])
            )
            await talk.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            picked = _set((await talk.read()).request_headers.response)[PICK].decode()
            assert picked == endpoint_of(fleet_state.get("i1").spec.url)
            handed = (await talk.read()).request_body.response.body_mutation.streamed_response
            assert orjson.loads(handed.body)["model"] == "canary-model"
            await _answer(talk)

            bad = Conversation(stub)
            await bad.send(request_headers=_headers([*_request(), (MODEL_REWRITE[0].decode(), "two words")]))
            await bad.send(request_body=pb.HttpBody(body=_chat(), end_of_stream=True))
            refused = (await bad.read()).immediate_response
            assert refused.status.code == 400
            assert orjson.loads(refused.body)["error"]["code"] == "invalid_model"
            assert sum(i.inflight for i in fleet_state) == 0
