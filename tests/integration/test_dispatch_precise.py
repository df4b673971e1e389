"""Precise mode: the gateway indexes each instance's KV events (the emulator publishes vLLM's wire)
and sends a prompt where its blocks really are, even blocks it never sent there itself."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from taogate.bench.procs import free_port
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.fleet.kv_index import KvIndex
from tests.conftest import wait_until

from .dispatch_helpers import MODEL, client, serve_gateway, settings_for

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
tokenizers = pytest.importorskip("tokenizers")


def _tokenizer(tmp: Path) -> Path:
    """Any tokenizer.json will do here: the prompts are token ids, which pass through as they are."""
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


async def test_prompts_follow_the_blocks_instances_really_hold(tmp_path: Path) -> None:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    configs = [
        EmulatorConfig(
            seed=i, enable_prefix_caching=True, enable_prompt_tokens_details=True, kv_events_endpoint=e
        )
        for i, e in enumerate(endpoints)
    ]
    prefix = list(range(1000, 1640))  # 40 blocks of 16
    async with run_fleet(configs) as fleet:
        settings = settings_for(
            fleet.urls,
            names=["i0", "i1"],
            prefill={"tokenizer": str(_tokenizer(tmp_path))},
            dispatch={"prefix_affinity": True},
        )
        for item, endpoint in zip(settings.instances, endpoints, strict=True):
            item.kv_events = endpoint
        async with serve_gateway(settings) as gate:
            gateway = gate.gateway
            indexes = [gateway.fleet.get(n).cache for n in ("i0", "i1")]
            await wait_until(lambda: all(c.index is not None for c in indexes), what="subscribed")
            async with httpx.AsyncClient(timeout=30, trust_env=False) as direct:

                async def direct_to_i1(prompt: list[int]) -> None:
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                    assert (
                        await direct.post(fleet.urls[1] + "/v1/completions", json=body)
                    ).status_code == 200

                # Events published before the subscription is through are lost (ZMQ's slow joiner):
                # throwaway prompts until one is seen, then the prefix, behind the gateway's back.
                for attempt in range(100):
                    await direct_to_i1([50_000 + attempt] * 40)
                    if len(indexes[1].index or ()) > 0:
                        break
                await direct_to_i1([*prefix, 7])
                await wait_until(
                    lambda: (indexes[1].index or KvIndex(1, 16)).cached_run(index_hashes(prefix)) >= 39,
                    what="i1's blocks indexed",
                )
            async with client() as http:
                for n in range(4):
                    body = {"model": MODEL, "prompt": [*prefix, 9, n], "max_tokens": 1}
                    reply = await http.post(gate.api_base + "/completions", json=body)
                    assert reply.status_code == 200
                    assert reply.headers["x-taogate-instance"] == "i1"
                    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 624


def index_hashes(prefix: list[int]) -> list[int]:
    from taogate.dispatch.blocks import block_hashes

    return block_hashes(prefix, 16)
