"""``[[keys]]`` entries in a config file, added and removed as text: the rest of the file, comments
and layout included, stays as it was. Every edit is parsed back and checked before it is kept."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from typing import Any

import tomli_w

__all__ = ["add_key", "remove_key"]

_HEADER = re.compile(r"^\s*\[")
_KEYS_HEADER = re.compile(r"^\s*\[\[\s*keys\s*\]\]\s*(#.*)?$")


def _entries(text: str) -> list[dict[str, Any]]:
    keys = tomllib.loads(text).get("keys", [])
    if not isinstance(keys, list):
        raise ValueError("`keys` in this file is not a list of [[keys]] tables")
    return keys


def add_key(text: str, name: str, sha256: str, limits: Mapping[str, Any]) -> str:
    """``text`` with a ``[[keys]]`` entry for ``name`` appended (its hash, never the key)."""
    if any(k.get("name") == name for k in _entries(text)):
        raise ValueError(f"a key named {name!r} is already in the file: revoke it first")
    entry = {"name": name, "key_sha256": sha256, **{k: v for k, v in limits.items() if v is not None}}
    block = "[[keys]]\n" + tomli_w.dumps(entry)
    out = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block
    if _entries(out)[-1] != entry:
        raise ValueError("the file ends inside a table or an array; add the [[keys]] entry by hand")
    return out


def remove_key(text: str, name: str) -> str:
    """``text`` without the ``[[keys]]`` entry named ``name`` (its header up to the next table; the
    comments just before the next table stay with it)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _HEADER.match(line)]
    for n, start in enumerate(starts):
        if not _KEYS_HEADER.match(lines[start]):
            continue
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        if tomllib.loads("".join(lines[start:end])).get("keys", [{}])[0].get("name") != name:
            continue
        cut = start - 1 if start > 0 and not lines[start - 1].strip() else start  # and its blank line
        out = "".join(lines[:cut] + lines[end:])
        before = [k for k in _entries(text) if k.get("name") != name]
        if _entries(out) != before:
            raise ValueError(f"could not remove {name!r} cleanly; edit the file by hand")
        return out
    raise KeyError(name)
