"""A deterministic stand-in tokenizer, chat template and text generator.

The rule (documented because tests and demos reason about token counts):

- Special markers ``<|name|>`` are one token each; otherwise a token is a run of ASCII letters/digits
  (a word), or any single other non-space character (each CJK character and each punctuation mark is
  its own token). Whitespace only separates. ``"Hello, 世界!"`` is 5 tokens.
- A token's id is ``crc32(piece) % 31997 + 3`` (ids 0..2 are reserved like BOS/EOS/PAD), stable across
  processes and runs, so equal text always gives equal ids and the prefix cache behaves like vLLM's.
- Chat messages are rendered through one fixed ChatML-like template before tokenizing, so a shared
  system prompt yields a shared token prefix.
- Generated text cycles through a fixed word list, starting at an offset derived from the prompt, so
  the same prompt always produces the same answer.

It is intentionally *not* any real model's tokenizer: the gateway must learn token counts from
``usage`` rather than rely on this rule.
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = [
    "GENERATED_WORDS",
    "VOCAB_SIZE",
    "Tokenizer",
    "render_chat",
]

VOCAB_SIZE = 32_000
_RESERVED = 3
_PIECE = re.compile(r"<\|[A-Za-z_]+\|>|[A-Za-z0-9]+|[^\sA-Za-z0-9]")

GENERATED_WORDS: tuple[str, ...] = (
    "the", "engine", "emulates", "a", "fleet", "of", "vllm", "servers", "and", "each", "request",
    "is", "served", "in", "order", "with", "prefill", "then", "decode", "tokens", "until", "done",
)  # fmt: skip


def _piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % (VOCAB_SIZE - _RESERVED) + _RESERVED


class Tokenizer:
    """Text ↔ token ids under the rule above, with a bounded reverse map for ``/detokenize``.

    Ids are hashes, so decoding needs memory of which piece produced an id; the most recent pieces
    (and every generated word) are remembered, and unknown ids decode as ``<id:N>``.
    """

    def __init__(self, remember: int = 65_536) -> None:
        self._remember = remember
        self._pieces: OrderedDict[int, str] = OrderedDict()
        self._words = {_piece_id(w): w for w in GENERATED_WORDS}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = self._pieces
        for match in _PIECE.finditer(text):
            piece = match.group()
            tid = _piece_id(piece)
            ids.append(tid)
            if tid not in pieces:
                pieces[tid] = piece
                if len(pieces) > self._remember:
                    pieces.popitem(last=False)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Lossy inverse: pieces joined by single spaces (whitespace is not part of the rule)."""
        out = []
        for tid in ids:
            piece = self._words.get(tid) or self._pieces.get(tid)
            out.append(piece if piece is not None else f"<id:{tid}>")
        return " ".join(out)

    @staticmethod
    def generated_word(prompt_ids: Sequence[int], index: int) -> str:
        """The ``index``-th generated word for this prompt (deterministic, no model involved)."""
        offset = (prompt_ids[-1] if prompt_ids else 0) + len(prompt_ids)
        return GENERATED_WORDS[(offset + index) % len(GENERATED_WORDS)]

    @staticmethod
    def generated_id(word: str) -> int:
        return _piece_id(word)


def _content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(str(p) for p in parts)
    raise TypeError("message content must be a string or a list of content parts")


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """Render messages through the fixed template ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

    Raises ``TypeError``/``KeyError`` on malformed messages; the protocol layer turns those into 400s.
    """
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError("each message must be an object")
        role = message["role"]
        if not isinstance(role, str):
            raise TypeError("message role must be a string")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
