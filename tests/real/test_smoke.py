"""The real servers themselves, without the gateway: the routes, the metrics we rely on, the slow card."""

from __future__ import annotations

import json
import random
import re
import statistics
import time
import uuid
from typing import Any

import httpx
import pytest

from taogate.dispatch.blocks import block_hashes
from tests.real.conftest import Pair, Say
from tests.real.home import Prepared
from tests.real.kv_events import KvListener
from tests.real.server import VllmServer

# What the gateway scrapes or what the tier's later tests read from vLLM's /metrics.
METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
)
PROSE = "the gateway sends each request to the card with the least prefill work queued and learns"
WORDS = PROSE.split()


def sse_payloads(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body in order, JSON-decoded except the final ``[DONE]``."""
    payloads: list[Any] = []
    for event in body.split("\n\n"):
        lines = [line for line in event.splitlines() if line]
        if not lines:
            continue
        assert all(line.startswith("data: ") for line in lines), event
        data = "\n".join(line.removeprefix("data: ") for line in lines)
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def generate(http: httpx.Client, server: VllmServer, path: str, body: dict[str, Any]) -> httpx.Response:
    response = http.post(server.url + path, json={"model": server.spec.served_model_name, **body})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions(card: VllmServer, http: httpx.Client, stream: bool) -> None:
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if not stream:
        reply = generate(http, card, "/v1/completions", body).json()
        assert reply["object"] == "text_completion"
        assert reply["model"] == card.spec.served_model_name
        assert reply["usage"]["completion_tokens"] == 8
        assert isinstance(reply["choices"][0]["text"], str)
        return
    response = generate(
        http, card, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_payloads(response.text)
    assert done == "[DONE]"
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_completions(card: VllmServer, http: httpx.Client, stream: bool) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    if not stream:
        reply = generate(http, card, "/v1/chat/completions", body).json()
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"]["role"] == "assistant"
        # The ChatML template wraps the one message: more prompt tokens than the word alone.
        assert reply["usage"]["prompt_tokens"] > 3
        assert reply["usage"]["completion_tokens"] == 8
        return
    response = generate(
        http,
        card,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_payloads(response.text)
    assert done == "[DONE]"
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_metrics_have_what_we_rely_on(card: VllmServer, http: httpx.Client) -> None:
    response = http.get(card.url + "/metrics")
    assert response.status_code == 200
    samples = {match.group(1) for match in re.finditer(r"^([a-zA-Z_:][\w:]*)[{ ]", response.text, re.M)}
    assert set(METRICS) <= samples, sorted(set(METRICS) - samples)
    info = re.search(r"^vllm:cache_config_info\{(.*)\} 1\.0$", response.text, re.M)
    assert info is not None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels["block_size"] == "128" and int(labels["num_gpu_blocks"]) > 0


def unique_prompt(words: int) -> str:
    """A prompt no earlier request shares a block with, so the prefix cache cannot shorten it."""
    rng = random.Random()
    return uuid.uuid4().hex + " " + " ".join(rng.choices(WORDS, k=words))


def prefill_seconds(http: httpx.Client, server: VllmServer, prompt: str) -> tuple[float, int]:
    started = time.perf_counter()
    reply = generate(http, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    return time.perf_counter() - started, reply["usage"]["prompt_tokens"]


def test_slow_card_is_slower_at_prefill(vllm_pair: Pair, http: httpx.Client, report: Say) -> None:
    timings: dict[str, list[float]] = {"fast": [], "slow": []}
    tokens = 0
    for _ in range(3):
        for server in vllm_pair.servers:
            seconds, tokens = prefill_seconds(http, server, unique_prompt(1500))
            timings[server.spec.label].append(seconds)
    fast, slow = (statistics.median(timings[label]) for label in ("fast", "slow"))
    report(f"prefill of {tokens} tokens: fast {fast:.3f} s, slow {slow:.3f} s, slow/fast {slow / fast:.1f}")
    assert slow > 1.5 * fast


def test_kv_events_reach_a_subscriber(vllm_pair: Pair, prepared: Prepared, http: httpx.Client) -> None:
    fast = vllm_pair.fast
    assert fast.kv_events_endpoint is not None
    block = 128
    with KvListener(prepared.python, fast.kv_events_endpoint) as listener:
        # The publisher connects on its own schedule and drops what it sent before: retry fresh prompts.
        deadline = time.monotonic() + 30.0
        frames: list[dict[str, Any]] = []
        full_blocks: set[int] = set()
        # Wait for an event of one of our prompts: a late batch of an earlier test's may come first.
        while not any(
            e["type"] == "BlockStored" and len(e["block_hashes"]) in full_blocks
            for f in frames
            for e in f["payload"][1]
        ):
            assert time.monotonic() < deadline, f"no BlockStored event within 30 s; frames: {frames}"
            reply = generate(http, fast, "/v1/completions", {"prompt": unique_prompt(400), "max_tokens": 1})
            full_blocks.add(reply.json()["usage"]["prompt_tokens"] // block)
            frames += listener.frames(wait=2.0)
    assert all(f["parts"] == 3 and f["topic"] == "kv" and len(f["seq_hex"]) == 16 for f in frames)
    assert [f["seq"] for f in frames] == sorted(f["seq"] for f in frames)
    stored = []
    for frame in frames:
        timestamp, events, rank = frame["payload"]
        assert isinstance(timestamp, float) and rank == 0
        stored += [event for event in events if event["type"] == "BlockStored"]
    for event in stored:
        assert event["block_size"] == block
        assert len(event["token_ids"]) == block * len(event["block_hashes"])
    # Only full blocks are stored: one of our prompts' whole blocks, in one event.
    assert any(len(event["block_hashes"]) in full_blocks for event in stored), (full_blocks, stored)
    # Precise dispatch names blocks as vLLM does: our hash chain over a prompt's token ids gives the
    # numbers vLLM published for them.
    roots = [event for event in stored if event.get("parent_block_hash") is None]
    assert roots, stored
    for event in roots:
        assert event["block_hashes"] == block_hashes(event["token_ids"], block), event
