"""Prefix keys: which requests share the start of their prompt, so they can meet the same instance.

vLLM's prefix caching skips the prefill of leading blocks already in that instance's KV cache; it
pays only when requests sharing a prefix go to the same instance. The shared part hashed here:

* **Chat** (and Responses with a message list): everything but the last message (system prompt,
  tool schemas, history): what the next turn, or another question under the same system prompt,
  repeats.
* **A single message or a plain prompt**: its first ``BLOCK_CHARS`` characters (about 256 tokens).
  Its following whole blocks are hashed too, each on all before it (``chain``, up to ``MAX_BLOCKS``):
  ``prefix_chains`` measures on them how much more than the first block each instance was sent.
* Under ``MIN_PREFIX_CHARS``, or embeddings and /tokenize: no key.

The model is part of the key (two models never share a KV cache), and at most ``MAX_ITEMS`` messages
and parts are read, so a huge body costs no more than a normal one. Why these cuts:
benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from .tokens import MAX_ITEMS, PromptSize, measure_text, route_kind

__all__ = [
    "BLOCK_CHARS",
    "MAX_BLOCKS",
    "MIN_PREFIX_CHARS",
    "SharedPrefix",
    "prefix_key",
    "shared_prefix",
]

BLOCK_CHARS: Final = 1024
MIN_PREFIX_CHARS: Final = 512
#: Blocks of a prompt that are hashed: 64 K characters, about 16 K tokens.
MAX_BLOCKS: Final = 64
_BLOCK_IDS: Final = 256  # the same block for token-id prompts
_MIN_IDS: Final = 128


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A prefix key and the size of the part it covers (what a cache hit saves, at least).

    ``chain``: the hashes of the whole blocks that follow the key's, each on everything before it,
    and ``text`` the prompt they were cut from; empty for a conversation's history, whose key
    covers all of it. The hashes are Python's own, seeded per process: chains are only compared
    within the process that made them."""

    key: int
    size: PromptSize
    chain: tuple[int, ...] = ()
    text: str = ""


def _hasher(*parts: bytes) -> Any:
    h = hashlib.blake2b(digest_size=8, person=b"taogate-prefix")
    for part in parts:
        _feed(h, part)
    return h


def _feed(h: Any, part: bytes) -> None:
    h.update(len(part).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
    h.update(part)


def _hash(*parts: bytes) -> int:
    return int.from_bytes(_hasher(*parts).digest(), "big")


def _canonical(value: object) -> bytes:
    return orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def _message_text(msg: object, budget: int) -> tuple[str, int]:
    """The text of one message (non-text parts contribute nothing), reading at most ``budget``
    content parts; and how many items it read."""
    if isinstance(msg, str):
        return msg, 1
    if not isinstance(msg, Mapping):
        return "", 1
    content = msg.get("content")
    if isinstance(content, str):
        return content, 1
    out: list[str] = []
    read = 1
    if isinstance(content, list):
        for part in itertools.islice(content, max(1, budget)):
            read += 1
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
    return "".join(out), read


def _leading_block(model: bytes, extra: bytes, text: str) -> SharedPrefix | None:
    if len(text) < MIN_PREFIX_CHARS:
        return None
    block = text[:BLOCK_CHARS]
    key = _hash(model, extra, b"text", block.encode())
    end = min(len(text), BLOCK_CHARS * MAX_BLOCKS) // BLOCK_CHARS * BLOCK_CHARS
    if end <= BLOCK_CHARS:
        return SharedPrefix(key, measure_text(block))
    # The builtin hash: a quarter of blake2b's cost on a long prompt, and chains never leave here.
    chained = key
    hashes: list[int] = []
    for start in range(BLOCK_CHARS, end, BLOCK_CHARS):
        chained = hash((chained, text[start : start + BLOCK_CHARS]))
        hashes.append(chained)
    return SharedPrefix(key, measure_text(block), tuple(hashes), text)


def _from_prompt(model: bytes, prompt: object) -> SharedPrefix | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one is the one prompt
    if isinstance(prompt, str):
        return _leading_block(model, b"", prompt)
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int and type(prompt[-1]) is int:
        if len(prompt) < _MIN_IDS:
            return None
        ids = prompt[:_BLOCK_IDS]
        return SharedPrefix(_hash(model, b"ids", _canonical(ids)), PromptSize(tokens=len(ids)))
    return None  # batches of several prompts: no single prefix to steer by


def _from_messages(model: bytes, messages: object, extra: object) -> SharedPrefix | None:
    if not isinstance(messages, list) or not messages:
        return None
    tools = _canonical(extra) if extra is not None else b""
    h = _hasher(model, tools, b"history")
    budget = MAX_ITEMS
    texts: list[str] = []
    for msg in itertools.islice(messages, len(messages) - 1):  # the history: all but the last
        if budget <= 0:
            break
        text, read = _message_text(msg, budget)
        budget -= read
        texts.append(text)
        _feed(h, _canonical(msg))
    if sum(len(t) for t in texts) >= MIN_PREFIX_CHARS:
        size = PromptSize(messages=len(texts))
        for t in texts:
            size += measure_text(t)
        return SharedPrefix(int.from_bytes(h.digest(), "big"), size)
    # One message, or a history too short to matter: the leading block of the whole conversation.
    head: list[str] = []
    chars = 0
    budget = MAX_ITEMS
    for msg in messages:
        if chars >= BLOCK_CHARS or budget <= 0:
            break
        text, read = _message_text(msg, budget)
        budget -= read
        head.append(text)
        chars += len(text)
    return _leading_block(model, tools, "".join(head))


def shared_prefix(route: str, body: Mapping[str, Any]) -> SharedPrefix | None:
    """The prefix key of a request and the size of what it covers, or None (no prefix worth it)."""
    model_value = body.get("model")
    model = model_value.encode() if isinstance(model_value, str) else b""
    kind = route_kind(route)
    if kind == "chat":
        return _from_messages(model, body.get("messages"), body.get("tools"))
    if kind == "completions":
        return _from_prompt(model, body.get("prompt"))
    if kind == "responses":
        value = body.get("input")
        instructions = body.get("instructions")
        extra = [instructions, body.get("tools")] if instructions or body.get("tools") else None
        if isinstance(value, str):
            head = instructions if isinstance(instructions, str) else ""
            # Only as much as the chain reads: a huge input is not copied whole.
            value = value[: BLOCK_CHARS * MAX_BLOCKS]
            return _leading_block(model, _canonical(extra) if extra else b"", head + value)
        return _from_messages(model, value, extra)
    return None


def prefix_key(route: str, body: Mapping[str, Any]) -> int | None:
    """A stable unsigned 64-bit hash of the prompt's shared part (see the module docstring), or None."""
    found = shared_prefix(route, body)
    return None if found is None else found.key
