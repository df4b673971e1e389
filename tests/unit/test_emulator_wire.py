"""Tokenizer rule, request parsing and error shapes, faults updates, CLI option parsing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import typer

from taogate.emulator.cli import build_configs, parse_slow
from taogate.emulator.config import EmulatorConfig, Faults, FaultsError
from taogate.emulator.errors import ApiError
from taogate.emulator.protocol import parse_chat, parse_completion, parse_embedding, parse_json
from taogate.emulator.tokenizer import Tokenizer, render_chat

CFG = EmulatorConfig(max_model_len=64)


def test_tokenizer_rule() -> None:
    tok = Tokenizer()
    ids = tok.encode("Hello, 世界!")
    assert len(ids) == 5
    assert ids == Tokenizer().encode("Hello ,世界 !")  # whitespace only separates
    assert all(3 <= i < 32_000 for i in ids)
    assert tok.decode(ids) == "Hello , 世 界 !"
    assert tok.decode([1]) == "<id:1>"
    assert len(tok.encode("<|im_start|>user")) == 2


def test_chat_template_gives_a_stable_prefix() -> None:
    system = {"role": "system", "content": "You are terse."}
    a = Tokenizer().encode(render_chat([system, {"role": "user", "content": "one"}]))
    b = Tokenizer().encode(
        render_chat([system, {"role": "user", "content": [{"type": "text", "text": "two"}]}])
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common == 9  # <|im_start|> system You are terse . <|im_end|> <|im_start|> user


def _err(fn: Any, payload: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(payload, Tokenizer(), CFG)
    return info.value


def test_completion_parsing_and_defaults() -> None:
    req = parse_completion({"prompt": "a b c", "stream": True}, Tokenizer(), CFG)
    assert (req.model, len(req.prompt_ids), req.max_tokens, req.stream) == ("emulated-model", 3, 16, True)
    assert parse_completion({"prompt": [[5, 6]]}, Tokenizer(), CFG).prompt_ids == [5, 6]
    assert parse_completion({"prompt": "a " * 60}, Tokenizer(), CFG).max_tokens == 4  # clipped to context
    # vLLM clamps max_tokens to the room the prompt leaves, and coerces lax types as pydantic does.
    assert parse_completion({"prompt": "a", "max_tokens": 64}, Tokenizer(), CFG).max_tokens == 63
    lax = parse_completion({"prompt": "a", "stream": "yes", "max_tokens": "5"}, Tokenizer(), CFG)
    assert lax.stream and lax.max_tokens == 5


@pytest.mark.parametrize(
    ("payload", "status", "fragment", "kind", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "Valid aliases: emulated-model", "NotFoundError", "model"),
        ({}, 400, "Either prompt or prompt_embeds", "BadRequestError", "prompt"),
        ({"prompt": "a " * 65}, 400, "at least 65 input tokens", "BadRequestError", "input_tokens"),
        ({"prompt": "a", "max_tokens": 65}, 400, "cannot be greater than", "BadRequestError", "max_tokens"),
        ({"prompt": "a", "n": 2}, 400, "n > 1", "BadRequestError", "n"),
        ({"prompt": "a", "n": 2, "temperature": 0}, 400, "greedy", "BadRequestError", None),
        ({"prompt": ["a", "b"]}, 400, "batched prompts", "BadRequestError", "prompt"),
        ({"prompt": "a", "max_tokens": 0}, 400, "at least 1, got 0", "BadRequestError", "max_tokens"),
        ({"prompt": "a", "max_tokens": "five"}, 400, "int_parsing", "Bad Request", "body.max_tokens"),
        ({"prompt": "a", "stream": "maybe"}, 400, "bool_parsing", "Bad Request", "body.stream"),
        ({"prompt": "a", "temperature": "hot"}, 400, "float_parsing", "Bad Request", "body.temperature"),
        (
            {"prompt": "a", "stream_options": {"include_usage": True}},
            400,
            "only be defined when `stream=True`",
            "BadRequestError",
            "stream_options",
        ),
    ],
)
def test_completion_errors(
    payload: dict[str, Any], status: int, fragment: str, kind: str, param: str | None
) -> None:
    err = _err(parse_completion, payload)
    assert err.status == status and fragment in err.message
    body = orjson.loads(err.body())["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    assert (body["type"], body["param"]) == (kind, param)


def test_chat_and_embedding_parsing() -> None:
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}, Tokenizer(), CFG
    )
    assert chat.kind == "chat" and chat.max_tokens == 3
    assert _err(parse_chat, {"messages": []}).status == 400
    assert _err(parse_chat, {"messages": [{"content": "no role"}]}).status == 400
    emb = parse_embedding({"input": ["a b", "c"], "encoding_format": "base64"}, Tokenizer(), CFG)
    assert [len(i) for i in emb.inputs] == [2, 1] and emb.base64
    assert _err(parse_embedding, {"input": "a " * 65}).status == 400
    assert _err(parse_chat, {}).param == "body.messages"
    for raw, param in ((b"{nope", "body.1"), (b"[1, 2]", "body"), (b"", "body")):
        with pytest.raises(ApiError, match="1 validation error") as info:
            parse_json(raw)
        assert (info.value.kind, info.value.param) == ("Bad Request", param)


def test_faults_merge_validates_everything_first() -> None:
    faults = Faults()
    faults.merge({"error_rate": 0.5, "hang": True, "close_mid_stream": 3})
    assert (faults.error_rate, faults.hang, faults.close_mid_stream) == (0.5, True, 3)
    for bad in (
        {"nope": 1},
        {"hang": 1},
        {"error_rate": 2},
        {"latency_spike": -1},
        {"close_mid_stream": 1.5},
    ):
        with pytest.raises(FaultsError):
            faults.merge({"unhealthy": True, **bad})
    assert faults.unhealthy is False  # a rejected update changes nothing


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        EmulatorConfig(slowdown=0)
    assert EmulatorConfig().num_kv_blocks == 16_384


def test_cli_slow_cards() -> None:
    assert parse_slow(["3=2.5", "0=1.5"], 4) == {3: 2.5, 0: 1.5}
    for bad in (["3"], ["x=1"], ["4=2"], ["1=0"]):
        with pytest.raises(typer.BadParameter):
            parse_slow(bad, 4)
    configs = build_configs(EmulatorConfig(faults=Faults(hang=True)), 3, ["2=3"])
    assert [c.slowdown for c in configs] == [1.0, 1.0, 3.0]
    assert len({c.seed for c in configs}) == 3
    assert configs[0].faults is not configs[1].faults and configs[1].faults.hang
