"""Prompt size from an OpenAI request body, without the model's tokenizer.

Dispatch must weigh a prompt before it is sent; the exact count only comes back afterwards, in
``usage.prompt_tokens``. So ``measure(route, body)`` counts what the model will see as features
(``PromptSize``: ASCII, CJK and other characters, chat messages, non-text parts, tokens known
exactly), and ``calibration.TokenEstimator`` turns them into tokens with one linear rule per model,
calibrated online from ``usage.prompt_tokens``. With a tokenizer configured (``load_exact_counter``),
plain prompts are counted exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import orjson

__all__ = [
    "MAX_ITEMS",
    "ExactCounter",
    "PromptSize",
    "TokenizerUnavailable",
    "load_exact_counter",
    "measure",
    "measure_text",
    "prompt_size",
    "route_kind",
]

#: Ideographs, kana, hangul, CJK punctuation and full-width forms: about one token per 1–1.5 chars.
_CJK = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u31ff\u3200-\u9fff"
    "\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef\U00020000-\U0003ffff]"
)


@dataclass(init=False, slots=True)
class PromptSize:
    """What the model will see, as features a linear token rule can weigh. A value, never changed
    once built (not frozen: that costs an ``object.__setattr__`` call per field, once per request)."""

    ascii: int = 0  # ASCII characters (English, code, JSON, whitespace)
    cjk: int = 0  # CJK ideographs, kana, hangul, full-width forms
    other: int = 0  # other non-ASCII characters (accents, Cyrillic, emoji, ...)
    messages: int = 0  # chat messages (each carries template overhead)
    media: int = 0  # non-text parts (image, audio, file): a fixed cost each
    tokens: int = 0  # tokens known exactly: explicit token ids, or an exact tokenizer's count

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        ascii: int = 0,
        cjk: int = 0,
        other: int = 0,
        messages: int = 0,
        media: int = 0,
        tokens: int = 0,
    ) -> None:
        self.ascii = ascii
        self.cjk = cjk
        self.other = other
        self.messages = messages
        self.media = media
        self.tokens = tokens

    def __add__(self, other: PromptSize) -> PromptSize:
        return PromptSize(
            self.ascii + other.ascii,
            self.cjk + other.cjk,
            self.other + other.other,
            self.messages + other.messages,
            self.media + other.media,
            self.tokens + other.tokens,
        )

    @property
    def chars(self) -> int:
        return self.ascii + self.cjk + self.other


class ExactCounter(Protocol):
    """Counts a plain text's tokens exactly (a local tokenizer)."""

    def count(self, text: str) -> int: ...


#: Items (prompts, messages, content parts) one measurement visits; past it, each list's rest is
#: extrapolated from the part visited, so millions of tiny items cost no more than this many.
MAX_ITEMS: Final = 4096
_MIN_VISITS: Final = 16
#: Longer non-ASCII texts are told CJK from other on an even sample of this many characters.
_SAMPLE_CHARS: Final = 1 << 16


def measure_text(text: str) -> PromptSize:
    """Character features of one string; C-speed for the all-ASCII common case."""
    n = len(text)
    if text.isascii():
        return PromptSize(ascii=n)
    ascii_n = len(text.encode("ascii", "ignore"))
    sample = text if n <= _SAMPLE_CHARS else text[:: n // _SAMPLE_CHARS + 1]
    cjk = min(n - ascii_n, round(len(_CJK.findall(sample)) * n / len(sample)))
    return PromptSize(ascii=ascii_n, cjk=cjk, other=n - ascii_n - cjk)


_KINDS: Final = frozenset({"chat", "completions", "embeddings", "responses", "tokenize"})


def route_kind(route: str) -> str:
    """'chat', 'completions', 'embeddings', 'responses', 'tokenize' or 'other'.

    ``route`` is a request path, matched on its end so a base_url prefix (``/api/v1/...``) does not
    matter, or already one of those kind names.
    """
    if route in _KINDS:
        return route
    path = route.rstrip("/")
    for suffix, kind in (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/embeddings", "embeddings"),
        ("/responses", "responses"),
        ("/tokenize", "tokenize"),
    ):
        if path.endswith(suffix) or path == suffix.lstrip("/"):
            return kind
    return "other"


class _Tally:
    """The features counted so far, and how many more items may be visited."""

    __slots__ = ("ascii", "budget", "cjk", "media", "messages", "other", "tokens")

    def __init__(self) -> None:
        self.ascii = self.cjk = self.other = self.messages = self.media = self.tokens = 0
        self.budget = MAX_ITEMS

    def text(self, text: str) -> None:
        if text.isascii():
            self.ascii += len(text)
        else:
            size = measure_text(text)
            self.ascii += size.ascii
            self.cjk += size.cjk
            self.other += size.other

    def snapshot(self) -> tuple[int, ...]:
        return (self.ascii, self.cjk, self.other, self.messages, self.media, self.tokens)

    def extrapolate(self, before: tuple[int, ...], visited: int, total: int) -> None:
        """Count the ``total - visited`` items not visited like the ``visited`` ones were."""
        (self.ascii, self.cjk, self.other, self.messages, self.media, self.tokens) = (
            b + (n - b) * total // visited for b, n in zip(before, self.snapshot(), strict=True)
        )


def _each(t: _Tally, items: list[Any], visit: Any, *extra: Any) -> None:
    """``visit(t, item, *extra)`` for a list's items while the budget lasts, then the rest
    extrapolated. A list met once the budget is spent still gets a few items visited (a short
    message after a huge one is not counted like the huge one), within a second budget."""
    before = t.snapshot()
    for i, item in enumerate(items):
        if t.budget <= 0 and i and (i >= _MIN_VISITS or t.budget <= -MAX_ITEMS):
            t.extrapolate(before, i, len(items))
            return
        t.budget -= 1
        visit(t, item, *extra)


def _is_ids(value: list[Any]) -> bool:
    """A list of token ids: its ends are checked, not every item (a mixed list is the engine's to refuse)."""
    return type(value[0]) is int and type(value[-1]) is int


def _prompt(t: _Tally, value: object, exact: ExactCounter | None) -> None:
    """A completions ``prompt`` / embeddings ``input``: str, list[str], list[int], list[list[int]]."""
    if isinstance(value, str):
        if exact is not None:
            t.tokens += exact.count(value)
        else:
            t.text(value)
    elif isinstance(value, list) and value:
        if _is_ids(value):
            t.tokens += len(value)
        else:
            _each(t, value, _prompt, exact)


def _part(t: _Tally, part: object) -> None:
    if isinstance(part, str):
        t.text(part)
    elif isinstance(part, Mapping):
        text = part.get("text")
        if isinstance(text, str):
            t.text(text)
        elif part.get("type") not in (None, "text", "input_text", "output_text"):
            t.media += 1


def _content(t: _Tally, value: object) -> None:
    """A message's ``content``: a string, or a list of parts of which only text parts are text."""
    if isinstance(value, str):
        t.text(value)
    elif isinstance(value, list):
        _each(t, value, _part)


def _json_text(t: _Tally, value: object) -> None:
    """Structured parts the template renders as JSON (tool calls, tool schemas)."""
    if isinstance(value, str):
        t.text(value)
    elif value is not None:
        with contextlib.suppress(TypeError):
            t.text(orjson.dumps(value).decode())


def _message(t: _Tally, msg: object) -> None:
    """One chat message (or a Responses input item): role name, content, tool calls, overhead."""
    if isinstance(msg, str):
        t.messages += 1
        t.text(msg)
    if not isinstance(msg, Mapping):
        return
    t.messages += 1
    for key in ("role", "name", "tool_call_id", "call_id"):
        field = msg.get(key)
        if isinstance(field, str):
            t.text(field)
    if "content" in msg:
        _content(t, msg.get("content"))
    for key in ("text", "output", "arguments"):  # Responses items that are not messages
        field = msg.get(key)
        if isinstance(field, str):
            t.text(field)
    if "tool_calls" in msg:
        _json_text(t, msg.get("tool_calls"))


def _messages(t: _Tally, value: object) -> None:
    if isinstance(value, list):
        _each(t, value, _message)


def measure(route: str, body: Mapping[str, Any], exact: ExactCounter | None = None) -> PromptSize:
    """Count what the model will see in ``body`` (an already-parsed JSON object) for ``route``.

    Never raises on odd bodies: an unknown shape counts as empty, and the estimate floor (1 token)
    applies. With ``exact``, plain-text completion prompts and embedding inputs are counted exactly
    (chat would also need the chat template, so it stays estimated). The work is bounded whatever
    the body: at most ``MAX_ITEMS`` items, the rest of a longer list extrapolated.
    """
    t = _Tally()
    kind = route_kind(route)
    if kind == "chat":
        _messages(t, body.get("messages"))
        _json_text(t, body.get("tools"))
    elif kind == "completions":
        _prompt(t, body.get("prompt"), exact)
        _prompt(t, body.get("suffix"), exact)
    elif kind == "embeddings":
        _prompt(t, body.get("input"), exact)
    elif kind == "responses":
        _json_text(t, body.get("instructions"))
        _json_text(t, body.get("tools"))
        value = body.get("input")
        if isinstance(value, str):
            t.text(value)
        else:
            _messages(t, value)
    elif kind == "tokenize":
        if "messages" in body:
            _messages(t, body.get("messages"))
        else:
            _prompt(t, body.get("prompt"), exact)
    # Unknown route: be generous rather than blind, the shapes above cover every OpenAI prompt field.
    elif "messages" in body:
        _messages(t, body.get("messages"))
    else:
        _prompt(t, body.get("prompt", body.get("input")), exact)
    return PromptSize(t.ascii, t.cjk, t.other, t.messages, t.media, t.tokens)


#: The name the gateway calls it by.
prompt_size = measure


# --- optional exact mode -----------------------------------------------------------------------------


class TokenizerUnavailable(Exception):
    """Exact counting was configured but cannot work here (package missing, file unreadable)."""


class _HFCounter:
    __slots__ = ("_tok",)

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=True).ids)


def load_exact_counter(path: str | Path) -> ExactCounter:
    """Load a local ``tokenizer.json`` with the optional ``tokenizers`` package.

    Raises ``TokenizerUnavailable`` naming what is missing, so the gateway can refuse to start with a
    clear message instead of silently falling back to estimates the operator did not ask for.
    """
    try:
        module = importlib.import_module("tokenizers")
    except ImportError as missing:
        raise TokenizerUnavailable(
            "[prefill] tokenizer is set, but the `tokenizers` package is not installed: "
            "pip install tokenizers (or unset [prefill] tokenizer to use calibrated estimates)"
        ) from missing
    file = Path(path)
    if not file.is_file():
        raise TokenizerUnavailable(f"[prefill] tokenizer = {str(file)!r}: no such file")
    try:
        tok = module.Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises its own exception type
        raise TokenizerUnavailable(f"[prefill] tokenizer = {str(file)!r} cannot be loaded: {exc}") from exc
    return _HFCounter(tok)
