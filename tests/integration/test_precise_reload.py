"""Precise mode switched on by a reload: the prompt tokenizer exists whenever ``[prefill] tokenizer``
is set, so an instance given ``kv_events`` later gets an index that requests can use; taken away,
the index goes with it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from taogate.bench.procs import free_port
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.proxy.routes import ROUTES
from tests.conftest import wait_until

from .dispatch_helpers import MODEL, client, serve_gateway, settings_for

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")


def _tokenizer(tmp: Path) -> Path:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


async def _facts_blocks(gateway: Any, prompt: list[int]) -> Any:
    body = f'{{"model": "{MODEL}", "prompt": {prompt}, "max_tokens": 1}}'.encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    route = next(r for r in ROUTES if r.kind == "completions")
    incoming = await gateway.pipeline.intake.read(
        route, [(b"content-length", str(len(body)).encode())], receive
    )
    return incoming.facts.blocks


@pytest.mark.timeout(30)
async def test_kv_events_added_by_a_reload_are_used(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = EmulatorConfig(enable_prefix_caching=True, kv_events_endpoint=endpoint)
    async with run_fleet([config]) as fleet:
        settings = settings_for(
            fleet.urls,
            names=["i0"],
            prefill={"tokenizer": str(_tokenizer(tmp_path))},
            dispatch={"prefix_affinity": True},
        )
        async with serve_gateway(settings) as gate:
            gateway = gate.gateway
            prompt = list(range(1000, 1400))
            assert await _facts_blocks(gateway, prompt) is None  # no index: nothing hashed
            added = settings.model_copy(deep=True)
            added.instances[0].kv_events = endpoint
            gateway.reload(added)
            cache = gateway.fleet.get("i0").cache
            await wait_until(lambda: cache.index is not None, what="subscribed")
            blocks = await _facts_blocks(gateway, prompt)
            assert blocks is not None and len(blocks.hashes(cache.index.block_size)) > 0
            async with client() as http:
                text = (await http.get(gate.url + "/metrics")).text
            for name in (
                "kv_events_gaps_total",
                "kv_events_restarts_total",
                "kv_index_trusted",
                "kv_index_usable",
            ):
                assert re.search(rf'^taogate_{name}\{{instance="i0"\}} ', text, re.M), name
            gateway.reload(settings)  # kv_events removed again
            await wait_until(lambda: cache.index is None, what="index dropped")
