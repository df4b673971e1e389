"""The real OpenAI SDK (async and sync) against an emulator on loopback."""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import openai
import pytest

from taogate.emulator import run_fleet

from .emulator_helpers import fast_config

MODEL = "emulated-model"


async def test_async_sdk_completions_chat_embeddings_models() -> None:
    async with run_fleet([fast_config(enable_prompt_tokens_details=True)]) as fleet:
        url = fleet.urls[0]
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            assert models.data[0].owned_by == "vllm"

            done = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
            assert done.choices[0].finish_reason == "length"
            assert len(done.choices[0].text.split()) == 5
            assert done.usage is not None
            assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 5)
            assert done.usage.prompt_tokens_details is not None
            assert done.usage.prompt_tokens_details.cached_tokens == 0

            stream = await client.completions.create(
                model=MODEL,
                prompt="one two",
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert len("".join(c.choices[0].text for c in chunks if c.choices).split()) == 4
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 4

            messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            assert chat.choices[0].message.role == "assistant"
            assert chat.choices[0].message.content and len(chat.choices[0].message.content.split()) == 3
            assert chat.usage is not None and chat.usage.total_tokens == chat.usage.prompt_tokens + 3

            cstream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            cchunks = [c async for c in cstream]
            assert cchunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in cchunks if c.choices)
            assert text == chat.choices[0].message.content  # deterministic generation
            assert cchunks[-1].usage is not None and cchunks[-1].usage.completion_tokens == 3

            emb = await client.embeddings.create(model=MODEL, input=["alpha beta", "gamma"])
            assert [len(d.embedding) for d in emb.data] == [64, 64]
            assert sum(v * v for v in emb.data[0].embedding) == pytest.approx(1.0, rel=1e-4)
            assert emb.usage.prompt_tokens == 3

        async with httpx.AsyncClient(base_url=url) as http:
            raw = await http.post("/v1/embeddings", json={"input": "alpha beta", "encoding_format": "base64"})
            vec = struct.unpack("<64f", base64.b64decode(raw.json()["data"][0]["embedding"]))
            assert vec == pytest.approx(emb.data[0].embedding, rel=1e-6)


async def test_sync_sdk_in_a_thread() -> None:
    async with run_fleet([fast_config()]) as fleet:

        def call() -> str | None:
            with openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0) as client:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
                )
                return reply.choices[0].finish_reason

        # The server runs on this loop, so the blocking client must run elsewhere.
        assert await asyncio.to_thread(call) == "length"


async def test_errors_in_vllm_shape() -> None:
    async with run_fleet([fast_config(max_model_len=100)]) as fleet:
        url = fleet.urls[0]
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model="other", prompt="x")
            assert missing.value.status_code == 404
            with pytest.raises(openai.BadRequestError, match="maximum context length is 100"):
                await client.completions.create(model=MODEL, prompt="word " * 150)
        async with httpx.AsyncClient(base_url=url) as http:
            # Request validation (FastAPI's layer in vLLM) says "Bad Request"; the engine's own checks
            # say BadRequestError.
            for body, kind in (
                (b"{not json", "Bad Request"),
                (b"[1, 2]", "Bad Request"),
                (b'{"model": "emulated-model"}', "BadRequestError"),
            ):
                r = await http.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                assert r.status_code == 400
                err = r.json()["error"]
                assert err["type"] == kind and err["code"] == 400 and "message" in err
            r = await http.post("/v1/chat/completions", json={"model": MODEL})
            assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages"
            assert (await http.get("/nope")).status_code == 404
            assert (await http.get("/v1/completions")).status_code == 405
        stats = fleet.instances[0].stats()
        assert stats["errors"] == 6 and stats["in_flight"] == 0


async def test_small_endpoints() -> None:
    async with run_fleet([fast_config()]) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        health = await http.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert "version" in (await http.get("/version")).json()
        tok = (await http.post("/tokenize", json={"prompt": "Hello, 世界!"})).json()
        assert tok["count"] == 5 and tok["max_model_len"] == 32_768 and len(tok["tokens"]) == 5
        chat_tok = (
            await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        ).json()
        assert chat_tok["count"] == 6  # <|im_start|> user hi <|im_end|> <|im_start|> assistant
        assert (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json() == {
            "prompt": "Hello , 世 界 !"
        }
        assert (await http.post("/detokenize", json={"tokens": "x"})).status_code == 400
        models = (await http.get("/v1/models")).json()
        card = models["data"][0]
        assert (models["object"], card["object"], card["root"], card["max_model_len"]) == (
            "list",
            "model",
            "emulated-model",
            32_768,
        )
