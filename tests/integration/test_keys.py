"""Named client keys through real gateways on loopback: the OpenAI SDK reads the rate-limit headers
and raises RateLimitError, allow-lists, concurrency leases over whole streams, revocation by reload,
priority ceilings, and the attribution (access log, metrics, /admin/keys)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest
from typer.testing import CliRunner

from taogate.cli import app as cli
from taogate.config_files import load_settings
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.serving import serve_asgi
from tests.conftest import KEY, wait_until
from tests.integration.keys_helpers import (
    MODEL,
    SECRETS,
    chat,
    chat_once,
    keyed_gateway,
    keyed_settings,
    sdk,
)
from tests.integration.recording import Upstream

TEAM_A = {"name": "team-a", "key_env": "TEAM_A_KEY"}
TEAM_B = {"name": "team-b", "key_env": "TEAM_B_KEY"}


async def test_the_sdk_reads_the_rate_limit_headers_and_raises_rate_limit_error() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "requests_per_minute": 3, "tokens_per_minute": 100_000}, TEAM_B]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw, AsyncExitStack() as stack:
            client = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            remaining = []
            for _ in range(3):
                raw = await chat(client)
                assert raw.parse().choices[0].message.content
                assert raw.headers["x-ratelimit-limit-requests"] == "3"
                assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
                assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
                remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
            assert remaining == [2, 1, 0]
            with pytest.raises(openai.RateLimitError) as refused:
                await chat(client)
            err = refused.value
            assert err.code == "rate_limit_exceeded" and err.type == "requests"
            assert "Limit 3" in err.message
            assert int(err.response.headers["retry-after"]) >= 1
            assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
            # A key without limits, and the unified key, carry no rate-limit headers and are not limited.
            for key in (SECRETS["TEAM_B_KEY"], KEY):
                raw = await chat_once(gw, key)
                assert "x-ratelimit-limit-requests" not in raw.headers


async def test_tokens_are_reserved_at_admission_and_settled_from_usage() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "tokens_per_minute": 500}]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw, AsyncExitStack() as stack:
            client = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            raw = await chat(client, max_tokens=400)  # reserves the prompt's estimate and all 400
            reserved = 500 - int(raw.headers["x-ratelimit-remaining-tokens"])
            usage = raw.parse().usage
            assert usage is not None and usage.completion_tokens == 400
            counted = gw.gateway.limiter.local.state("team-a")
            assert counted is not None
            await wait_until(lambda: counted.tok_cur == usage.total_tokens, what="settled from usage")
            assert reserved != usage.total_tokens  # the estimate was not the usage: settling mattered
            with pytest.raises(openai.RateLimitError) as refused:
                await chat(client, max_tokens=480)
            assert refused.value.type == "tokens"


async def test_a_request_the_instance_refuses_gives_its_tokens_back() -> None:
    """vLLM's 400 (here: stream_options without stream) generated nothing: the reservation of its
    prompt and max_tokens is given back, where it used to stand for the whole window."""
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "tokens_per_minute": 1_000}]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw, AsyncExitStack() as stack:
            client = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            for _ in range(3):  # each reserved ~400 of the 1,000
                with pytest.raises(openai.BadRequestError):
                    await chat(client, max_tokens=400, stream_options={"include_usage": True})
            counted = gw.gateway.limiter.local.state("team-a")
            assert counted is not None
            await wait_until(lambda: counted.tok_cur == 0, what="the refused requests' tokens given back")
            raw = await chat(client, max_tokens=400)
            assert raw.http_response.status_code == 200


async def test_counting_a_prompt_s_tokens_spends_a_request_and_no_tokens() -> None:
    """Anthropic's count_tokens is limited by requests, not tokens: a key counting a long prompt
    several times has its whole token budget left (it was spent by each count until refused)."""
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "tokens_per_minute": 2_000, "requests_per_minute": 100}]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw:
            long = [{"role": "user", "content": "word " * 1_500}]
            with anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["TEAM_A_KEY"], max_retries=0) as client:
                for _ in range(4):
                    raw = await asyncio.to_thread(
                        client.messages.with_raw_response.count_tokens, model=MODEL, messages=long
                    )
                    assert raw.parse().input_tokens > 1_000
                    assert raw.headers["x-ratelimit-remaining-tokens"] == "2000"
                counted = gw.gateway.limiter.local.state("team-a")
                assert counted is not None and counted.tok_cur == 0 and counted.req_cur == 4
                counted.tok_cur = 5_000  # the key's tokens spent (by usage settled over its limit)
                raw = await asyncio.to_thread(
                    client.messages.with_raw_response.count_tokens, model=MODEL, messages=long
                )
                assert raw.parse().input_tokens > 1_000  # still counted: tokens are not its limit


async def test_a_model_outside_the_allow_list_is_not_found_and_not_listed() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "models": ["another-model"]}, {**TEAM_B, "models": [MODEL]}]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw, AsyncExitStack() as stack:
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            a = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            with pytest.raises(openai.NotFoundError) as refused:
                await chat(a)
            assert refused.value.code == "model_not_found"
            assert "do not have access" in refused.value.message
            assert [m.id for m in (await a.models.list()).data] == []
            b = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_B_KEY"]))
            assert [m.id for m in (await b.models.list()).data] == [MODEL]
            await chat(b)


async def test_max_concurrency_is_held_for_the_whole_stream_and_freed_by_a_disconnect() -> None:
    slow = EmulatorConfig(seed=0, step_overhead=0.02)
    async with run_fleet([slow]) as fleet, AsyncExitStack() as stack:
        settings = keyed_settings(fleet.urls, [{**TEAM_A, "max_concurrency": 1, "requests_per_minute": 60}])
        gw = await stack.enter_async_context(keyed_gateway(settings))
        stats = gw.gateway.limiter.stats["team-a"]
        client = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=200, stream=True
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        assert stats.in_flight == 1  # mid-stream: the lease is still held
        with pytest.raises(openai.RateLimitError, match="in flight") as busy:
            await chat(client)
        assert busy.value.response.headers["x-ratelimit-remaining-requests"] == "59"  # as every answer
        await stream.close()  # the client goes away mid-stream
        await wait_until(lambda: stats.in_flight == 0, what="the lease released by the disconnect")
        raw = await chat(client)  # and the key may send again
        assert raw.parse().choices
        await wait_until(lambda: stats.in_flight == 0, what="released after a whole answer")
        assert stats.rejections == {"concurrency": 1}


async def test_a_revoked_key_is_refused_after_reload_and_an_added_one_accepted(tmp_path: Path) -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        config = tmp_path / "config.toml"
        base = keyed_settings(fleet.urls, [])
        text = (
            "[gateway]\n"
            'host = "127.0.0.1"\n'
            "[dispatch]\n"
            "health_check_interval = 0.5\n"
            "warmup_tokens = 0\n"
            "".join(f'[[instances]]\nurl = "{i.url}"\nname = "{i.name}"\n' for i in base.instances)
        )
        config.write_text(text)
        runner = CliRunner()
        added = runner.invoke(
            cli, ["keys", "add", "team-x", "-c", str(config), "--requests-per-minute", "50"]
        )
        assert added.exit_code == 0, added.output
        secret = added.stdout.strip().splitlines()[0]
        assert secret.startswith("tg-") and secret not in config.read_text()
        async with keyed_gateway(load_settings(config), settings_source=lambda: load_settings(config)) as gw:
            await chat_once(gw, secret)
            listed = runner.invoke(cli, ["keys", "list", "-c", str(config)])
            assert "team-x" in listed.stdout and "rpm=50" in listed.stdout
            revoked = runner.invoke(cli, ["keys", "revoke", "team-x", "-c", str(config)])
            assert revoked.exit_code == 0, revoked.output
            later = runner.invoke(cli, ["keys", "add", "team-y", "-c", str(config)])
            newer = later.stdout.strip().splitlines()[0]
            with pytest.raises(openai.AuthenticationError):
                await chat_once(gw, newer)  # not yet: the gateway has not reloaded
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
                r = await http.post(gw.url + "/admin/reload")
                assert r.status_code == 200, r.text
                keys = (await http.get(gw.url + "/admin/keys")).json()
            with pytest.raises(openai.AuthenticationError):
                await chat_once(gw, secret)
            await chat_once(gw, newer)
            assert [k["name"] for k in keys["keys"]] == ["unified", "team-y"]
            assert keys["limits"]["store"] == "in-process"


async def test_a_priority_above_the_key_s_ceiling_is_lowered_to_it_and_no_key_goes_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="taogate.access")
    told = Upstream("ranked")
    lines: list[str] = []
    async with serve_asgi(told) as up:
        keys = [{**TEAM_A, "max_priority": -5}]
        settings = keyed_settings([up.url], keys, dispatch={"scrape_interval": 0})
        settings.instances[0].scheduling_policy = "priority"
        async with keyed_gateway(settings, access=lines) as gw, httpx.AsyncClient(timeout=30) as http:
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            body = orjson.dumps({"model": "ranked", "messages": [], "priority": -9})
            for key, told_class in ((KEY, b"0"), (SECRETS["TEAM_A_KEY"], b"-5")):
                headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
                r = await http.post(gw.url + "/v1/chat/completions", content=body, headers=headers)
                assert r.status_code == 200
                assert told.seen[-1].body == body[:-1] + b',"priority":' + told_class + b"}"
                seen = told.seen[-1].headers  # a client's key never goes upstream
                assert "authorization" not in seen and not any(key in v for v in seen.values())
    assert any("key=unified" in line and "priority=" not in line for line in lines), lines
    assert any("key=team-a" in line and "priority=-5" in line for line in lines), lines


async def test_attribution_access_log_metrics_and_admin_rows(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="taogate.access")
    lines: list[str] = []
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "requests_per_minute": 2}, TEAM_B]
        async with (
            keyed_gateway(keyed_settings(fleet.urls, keys), access=lines) as gw,
            AsyncExitStack() as stack,
        ):
            a = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            for _ in range(2):
                await chat(a)
            with pytest.raises(openai.RateLimitError):
                await chat(a)
            await chat_once(gw, SECRETS["TEAM_B_KEY"])
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
                metrics = (await http.get(gw.url + "/metrics")).text
                rows = (await http.get(gw.url + "/admin/instances")).json()["keys"]
    assert sum("key=team-a" in line for line in lines) == 3
    assert sum("key=team-b" in line for line in lines) == 1
    assert 'taogate_key_requests_total{key="team-a"} 2.0' in metrics
    assert 'taogate_key_rejections_total{key="team-a",reason="requests"} 1.0' in metrics
    assert 'taogate_key_in_flight{key="team-b"} 0.0' in metrics
    assert 'taogate_key_tokens_total{key="team-b",kind="completion"} 3.0' in metrics
    assert "taogate_limits_store_up 1.0" in metrics
    a_row = next(r for r in rows if r["name"] == "team-a")
    assert a_row["requests"] == 2 and a_row["window_used"]["requests"] == 2
    assert a_row["rejections"] == {"requests": 1}


async def test_fair_share_serves_a_light_key_before_a_flooding_one() -> None:
    """One instance with one slot: the heavy key queues twenty requests first, then the light key
    sends two; they go ahead of most of the heavy key's, which have used far more tokens."""
    one = EmulatorConfig(seed=0, max_num_seqs=1, step_overhead=0.005)
    async with run_fleet([one]) as fleet:
        settings = keyed_settings(fleet.urls, [TEAM_A, TEAM_B], dispatch={"max_queue_per_instance": 1})
        async with keyed_gateway(settings) as gw:
            done: list[str] = []

            async def one_request(key: str, name: str) -> None:
                await chat_once(gw, SECRETS[key], max_tokens=4)
                done.append(name)

            heavy = [asyncio.create_task(one_request("TEAM_A_KEY", "heavy")) for _ in range(20)]
            await wait_until(lambda: gw.gateway.dispatcher.queued >= 15, what="the heavy key queued")
            light = [asyncio.create_task(one_request("TEAM_B_KEY", "light")) for _ in range(2)]
            await asyncio.gather(*heavy, *light)
    last_light = max(i for i, name in enumerate(done) if name == "light")
    assert last_light < 8, done


async def test_the_anthropic_sdk_sends_a_named_key_as_x_api_key_and_meets_its_limit() -> None:
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        keys = [{**TEAM_A, "requests_per_minute": 1}]
        async with (
            keyed_gateway(keyed_settings(fleet.urls, keys)) as gw,
            anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRETS["TEAM_A_KEY"], max_retries=0) as client,
        ):
            ask = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            raw = await client.messages.with_raw_response.create(**ask)
            assert raw.headers["x-ratelimit-remaining-requests"] == "0"
            with pytest.raises(anthropic.RateLimitError) as refused:
                await client.messages.create(**ask)
            assert int(refused.value.response.headers["retry-after"]) >= 1
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            assert [m.id async for m in client.models.list()] == [MODEL]  # its key as x-api-key


async def test_a_key_s_limits_are_not_talked_out_of() -> None:
    """A negative output limit would credit a key's token count; a request naming no model would
    reach whichever model an instance serves; a Responses answer's limit must be reserved."""
    async with run_fleet([EmulatorConfig(seed=0, instant=True)]) as fleet:
        keys = [{**TEAM_A, "tokens_per_minute": 500, "models": [MODEL]}]
        async with keyed_gateway(keyed_settings(fleet.urls, keys)) as gw, AsyncExitStack() as stack:
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            client = await stack.enter_async_context(sdk(gw, SECRETS["TEAM_A_KEY"]))
            with pytest.raises(openai.BadRequestError) as negative:
                await chat(client, max_tokens=-(10**15))
            assert negative.value.code == "invalid_request" and "max_tokens" in negative.value.message
            http = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=gw.url,
                    headers={"authorization": f"Bearer {SECRETS['TEAM_A_KEY']}"},
                    timeout=60,
                )
            )
            for path in ("/tokenize", "/invocations"):  # vLLM would use its own model
                r = await http.post(path, json={"messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["code"] == "missing_model"
            remaining = []
            for body in (
                {"model": MODEL, "input": "hi", "max_output_tokens": 400},
                {"model": MODEL, "input": "hi", "max_output_tokens": 400},
            ):
                r = await http.post("/v1/responses", json=body)
                remaining.append(r.headers.get("x-ratelimit-remaining-tokens"))
                if r.status_code == 429:
                    break
            assert r.status_code == 429, remaining  # 400 reserved twice passes 500
