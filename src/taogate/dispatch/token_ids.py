"""A request's own token ids, as vLLM will prefill them: what precise prefix-cache dispatch looks up.

With ``[prefill] tokenizer`` and the model's chat template, chat requests are rendered as vLLM
renders them (sandboxed Jinja, ``add_generation_prompt``) and encoded without special tokens;
completions prompts are encoded with them, and lists of ids are taken as they are. Anything not
reproduced here (batches, images, a failing template, ``UNREPRODUCED`` fields) gives no ids, and
those requests use the approximate cache model. Bounded: only a prefix worth steering is encoded, at
most ``max_tokens``, and ``PromptBlocks`` keeps only the block hashes in use. The details of the cut:
benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from .blocks import block_hashes, max_hit_blocks
from .tokens import TokenizerUnavailable, route_kind

__all__ = ["MAX_PREFIX_TOKENS", "UNREPRODUCED", "PromptBlocks", "PromptTokenizer", "load_prompt_tokenizer"]

#: The longest prefix hashed for a lookup. Encoding and hashing run per request on the event loop
#: (large bodies in a thread) and grow with it; past it the approximate model still counts the
#: rest of a shared prefix (``InstanceCache.hit`` takes the larger), and the instance with the
#: most of its first blocks is the one with the most of it in practice.
MAX_PREFIX_TOKENS: Final = 32_768
#: Characters of text encoded per token wanted: about what English averages.
CHARS_PER_TOKEN: Final = 4
#: Tokens dropped before a cut: the cut word, and a pre-tokenizer's look-ahead across it.
CUT_MARGIN: Final = 64

#: Request fields with which vLLM builds another prompt (or other hashes) than we would: a value
#: other than the default means no ids. ``add_generation_prompt`` is checked apart (True default).
UNREPRODUCED: Final = {
    "chat": (
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "documents",
        "reasoning_effort",
        "add_special_tokens",
        "truncate_prompt_tokens",
        "cache_salt",
        "mm_processor_kwargs",
    ),
    "completions": ("truncate_prompt_tokens", "cache_salt", "prompt_embeds"),
}


class PromptBlocks:
    """One prompt's block hashes per block size in use (its ids are not kept)."""

    __slots__ = ("_hashes",)

    def __init__(self, ids: Sequence[int], block_sizes: Iterable[int], *, whole: bool = True) -> None:
        """``whole``: ``ids`` is the entire prompt (its last token never hits), not a prefix of it."""
        hashes: dict[int, list[int]] = {}
        for size in block_sizes:
            n = max_hit_blocks(len(ids), size) if whole else len(ids) // size
            hashes[size] = block_hashes(ids[: n * size], size)
        self._hashes = hashes

    def hashes(self, block_size: int) -> list[int]:
        """The hashes for ``block_size`` (none when it was not in use as the request came in)."""
        return self._hashes.get(block_size, [])


def _raise(message: str) -> None:
    raise ValueError(message)


class PromptTokenizer:
    """Token ids of chat and completion requests, as vLLM renders and encodes them."""

    def __init__(self, tokenizer: Any, template: str | None, special: Mapping[str, str]) -> None:
        self._tok = tokenizer
        self._special = dict(special)
        self._template: Any = None
        if template is not None:
            sandbox = importlib.import_module("jinja2.sandbox")
            ext = importlib.import_module("jinja2.ext")
            env = sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
            )
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    def ids(self, route: str, body: Mapping[str, Any], max_tokens: int | None = None) -> list[int] | None:
        """The prompt's token ids, or its first ``max_tokens`` or fewer when it is longer."""
        found = self._ids(route, body, max_tokens)
        return found[0] if found is not None else None

    def _ids(self, route: str, body: Mapping[str, Any], cap: int | None) -> tuple[list[int], bool] | None:
        """(ids, whole): ``whole`` False when they are a prefix of the prompt."""
        kind = route_kind(route)
        if kind not in UNREPRODUCED or any(body.get(k) not in (None, False, {}) for k in UNREPRODUCED[kind]):
            return None
        try:
            if kind == "chat":
                if body.get("add_generation_prompt", True) is not True:
                    return None
                return self._chat(body, cap)
            return self._completion(body.get("prompt"), cap)
        except Exception:  # a template or an odd body: no precise score for this request
            return None

    def blocks(
        self, route: str, body: Mapping[str, Any], block_sizes: Iterable[int], max_tokens: int | None = None
    ) -> PromptBlocks | None:
        """The hashes for ``block_sizes`` of the prompt's first ``max_tokens`` tokens at most."""
        found = self._ids(route, body, max_tokens)
        return PromptBlocks(found[0], block_sizes, whole=found[1]) if found and found[0] else None

    def _encode(self, text: str, special: bool, cap: int | None) -> tuple[list[int], bool]:
        if cap is None or len(text) <= cap * CHARS_PER_TOKEN:
            ids: list[int] = self._tok.encode(text, add_special_tokens=special).ids
            return (ids, True) if cap is None or len(ids) <= cap else (ids[:cap], False)
        ids = self._tok.encode(text[: cap * CHARS_PER_TOKEN], add_special_tokens=special).ids
        return ids[: min(cap, max(0, len(ids) - CUT_MARGIN))], False

    def _chat(self, body: Mapping[str, Any], cap: int | None) -> tuple[list[int], bool] | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        kwargs: dict[str, Any] = {
            "messages": [_normalised(m) for m in messages],
            "add_generation_prompt": True,
            **self._special,
        }
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        return self._encode(self._template.render(**kwargs), False, cap)

    def _completion(self, prompt: object, cap: int | None) -> tuple[list[int], bool] | None:
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, True, cap)
        if isinstance(prompt, list) and prompt:
            head = prompt if cap is None else prompt[:cap]
            if all(type(x) is int for x in head):
                return list(head), len(head) == len(prompt)
        return None


def _normalised(message: object) -> object:
    """vLLM joins a message's text parts with newlines for templates that print ``content``; other
    parts (images) make the ids unknowable here."""
    if not isinstance(message, Mapping):
        return message
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
            else:
                raise ValueError("non-text content")
        return {**message, "content": "\n".join(texts)}
    return message


def _template_beside(path: Path) -> tuple[str | None, dict[str, str]]:
    """The chat template and special-token strings next to a tokenizer.json."""
    template: str | None = None
    special: dict[str, str] = {}
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        found = data.get("chat_template")
        if isinstance(found, str):
            template = found
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = data.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
    jinja = path.with_name("chat_template.jinja")
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template, special


def load_prompt_tokenizer(path: str | Path, chat_template: str | Path | None = None) -> PromptTokenizer:
    """Load the tokenizer (``tokenizers``) and the chat template (``jinja2``); both are the
    ``precise`` extra. ``TokenizerUnavailable`` names what is missing."""
    for module in ("tokenizers", "jinja2"):
        try:
            importlib.import_module(module)
        except ImportError as missing:
            raise TokenizerUnavailable(
                f"precise prefix-cache dispatch needs the `{module}` package: pip install 'taogate[precise]'"
            ) from missing
    file = Path(path)
    if not file.is_file():
        raise TokenizerUnavailable(f"[prefill] tokenizer = {str(file)!r}: no such file")
    try:
        tok = importlib.import_module("tokenizers").Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises its own exception type
        raise TokenizerUnavailable(f"[prefill] tokenizer = {str(file)!r} cannot be loaded: {exc}") from exc
    template, special = _template_beside(file)
    if chat_template is not None:
        template = Path(chat_template).read_text(encoding="utf-8")
    return PromptTokenizer(tok, template, special)
