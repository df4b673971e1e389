"""A request's own token ids, as vLLM renders and encodes them, and their block hashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taogate.dispatch.blocks import block_hashes
from taogate.dispatch.token_ids import PromptBlocks, load_prompt_tokenizer
from taogate.dispatch.tokens import TokenizerUnavailable

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(tmp: Path, template: str | None = CHATML) -> Path:
    words = ["[UNK]", "<s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "hello", "world"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    config: dict[str, object] = {"bos_token": "<s>"}
    if template is not None:
        config["chat_template"] = template
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_is_rendered_then_encoded_without_special_tokens(tmp_path: Path) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path))
    body = {"messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": "world"}]}
    assert tok.ids("/v1/chat/completions", body) == [2, 4, 7, 3, 2, 5, 8, 3, 2, 6]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert tok.ids("chat", parts) == [2, 5, 7, 3, 2, 6]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert tok.ids("chat", image) is None  # not knowable here: the approximate model applies


def test_completions_add_special_tokens_and_pass_ids_through(tmp_path: Path) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path))
    assert tok.ids("/v1/completions", {"prompt": "hello world"}) == [1, 7, 8]
    assert tok.ids("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.ids("completions", {"prompt": ["a", "b"]}) is None
    assert tok.ids("embeddings", {"input": "hello"}) is None


def test_without_a_template_chat_has_no_ids(tmp_path: Path) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path, template=None))
    assert tok.ids("chat", {"messages": [{"role": "user", "content": "hello"}]}) is None


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable, match="no such file"):
        load_prompt_tokenizer(tmp_path / "nope.json")


def test_blocks_are_vllms_hashes_of_what_can_hit() -> None:
    ids = list(range(64))
    blocks = PromptBlocks(ids, (16, 32))
    assert blocks.hashes(16) == block_hashes(ids[:48], 16)  # the last token never hits: 3 blocks
    assert blocks.hashes(32) == block_hashes(ids[:32], 32)
    assert blocks.hashes(16) is blocks.hashes(16)  # computed once per block size
    assert blocks.hashes(128) == []  # a size not in use: no hashes (the model decides)
    assert not hasattr(blocks, "ids")  # the ids are not kept while the request waits
    assert PromptBlocks(ids, (16,), whole=False).hashes(16) == block_hashes(ids, 16)  # a prefix


def test_only_a_prefix_worth_steering_is_encoded(tmp_path: Path) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path))
    words = ("hello world " * 5000).strip()
    full = tok.ids("completions", {"prompt": words})
    assert full is not None and len(full) == 10_001
    head = tok.ids("completions", {"prompt": words}, max_tokens=500)
    assert head is not None and 0 < len(head) <= 500 and head == full[: len(head)]
    blocks = tok.blocks("completions", {"prompt": words}, (16,), max_tokens=500)
    assert blocks is not None and blocks.hashes(16) == block_hashes(full[: len(head) // 16 * 16], 16)
    ids = tok.ids("completions", {"prompt": list(range(5000))}, max_tokens=100)
    assert ids == list(range(100))
    chat = {"messages": [{"role": "user", "content": words}]}
    whole = tok.ids("chat", chat)
    cut = tok.ids("chat", chat, max_tokens=300)
    assert whole is not None and cut is not None and 0 < len(cut) <= 300 and cut == whole[: len(cut)]


@pytest.mark.parametrize(
    "field",
    [
        {"chat_template": "{{ messages }}"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
        {"documents": [{"title": "t", "text": "x"}]},
        {"reasoning_effort": "low"},
        {"add_special_tokens": True},
        {"cache_salt": "s"},
        {"truncate_prompt_tokens": 5},
    ],
)
def test_a_prompt_vllm_builds_otherwise_has_no_ids(tmp_path: Path, field: dict[str, object]) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path))
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    assert tok.ids("chat", chat) is not None
    assert tok.ids("chat", {**chat, **field}) is None
    assert tok.ids("chat", {**chat, "chat_template_kwargs": {}, "continue_final_message": False}) is not None


def test_completions_with_salt_or_truncation_have_no_ids(tmp_path: Path) -> None:
    tok = load_prompt_tokenizer(_tokenizer(tmp_path))
    assert tok.ids("completions", {"prompt": "hello", "cache_salt": "s"}) is None
    assert tok.ids("completions", {"prompt": [1, 2], "truncate_prompt_tokens": 1}) is None
