"""A request's own token ids, as vLLM will prefill them: what precise prefix-cache dispatch looks up.

With ``[prefill] tokenizer`` (the model's local ``tokenizer.json``) and its chat template (``[prefill]
chat_template``, else ``chat_template`` in the ``tokenizer_config.json`` or a ``chat_template.jinja``
beside it), the ids are made as vLLM makes them:

* chat: the template rendered in a sandboxed Jinja environment with ``trim_blocks`` and
  ``lstrip_blocks``, ``messages``, ``tools``, ``add_generation_prompt=True`` and the special-token
  strings, then encoded *without* special tokens (the template writes BOS itself);
* completions: a string prompt encoded *with* special tokens; a list of ids as it is.

Anything else (batches, images, a template that fails) gives no ids: those requests are dispatched
by the approximate cache model. ``PromptBlocks`` turns the ids into vLLM's block hashes per block
size, once each, and only the blocks a hit can cover (never the last token).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .blocks import block_hashes, max_hit_blocks
from .tokens import TokenizerUnavailable, route_kind

__all__ = ["PromptBlocks", "PromptTokenizer", "load_prompt_tokenizer"]


class PromptBlocks:
    """One prompt's token ids and their block hashes (computed on first use per block size)."""

    __slots__ = ("_hashes", "ids")

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        found = self._hashes.get(block_size)
        if found is None:
            n = max_hit_blocks(len(self.ids), block_size)
            found = self._hashes[block_size] = block_hashes(self.ids[: n * block_size], block_size)
        return found


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

    def ids(self, route: str, body: Mapping[str, Any]) -> list[int] | None:
        kind = route_kind(route)
        try:
            if kind == "chat":
                return self._chat(body)
            if kind == "completions":
                return self._completion(body.get("prompt"))
        except Exception:  # a template or an odd body: no precise score for this request
            return None
        return None

    def blocks(self, route: str, body: Mapping[str, Any]) -> PromptBlocks | None:
        ids = self.ids(route, body)
        return PromptBlocks(ids) if ids else None

    def _chat(self, body: Mapping[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        kwargs: dict[str, Any] = {
            "messages": [_normalised(m) for m in messages],
            "add_generation_prompt": body.get("add_generation_prompt", True),
            **self._special,
        }
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, Mapping):
            kwargs.update(extra)
        text = self._template.render(**kwargs)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _completion(self, prompt: object) -> list[int] | None:
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self._tok.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and prompt and all(type(x) is int for x in prompt):
            return list(prompt)
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
        except ImportError as exc:
            raise TokenizerUnavailable(
                f"precise prefix-cache dispatch needs the `{module}` package: pip install 'taogate[precise]'"
            ) from exc
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
