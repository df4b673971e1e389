"""Bodies of vLLM's other routes read as one of the shapes dispatch measures (chat, completions,
embeddings inputs), so their prompt size is estimated the same way; none gets a prefix key except
what is a chat or completion underneath (``/invocations``)."""

from __future__ import annotations

from typing import Any

__all__ = ["batch_view", "invocation_view", "pooling_view"]

#: The text fields of the pooling, scoring and reranking requests.
_POOLING_TEXT = ("input", "text_1", "text_2", "data_1", "data_2", "queries", "documents", "items", "query")


def batch_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``/v1/chat/completions/batch``: ``messages`` is a list of conversations, weighed as one."""
    conversations = payload.get("messages")
    flat: list[object] = []
    if isinstance(conversations, list):
        for conversation in conversations:
            if isinstance(conversation, list):
                flat.extend(conversation)
    return "tokenize", {"messages": flat}


def _texts(value: object, out: list[object]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                text = item.get("text")
                if isinstance(text, str):
                    out.append(text)
            elif isinstance(item, str):
                out.append(item)
            elif isinstance(item, int):  # token ids: one prompt
                out.append(value)
                return


def pooling_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Pooling, classify, score and rerank: every text field, weighed like embeddings inputs."""
    if "messages" in payload:
        return "tokenize", {"messages": payload["messages"]}
    texts: list[object] = []
    for key in _POOLING_TEXT:
        _texts(payload.get(key), texts)
    return "embeddings", {"input": texts}


def invocation_view(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """SageMaker's ``/invocations`` serves whichever request the body is: chat when it has
    ``messages``, a completion when it has ``prompt``, pooling otherwise (vLLM's order)."""
    if "messages" in payload:
        return "chat", payload
    if "prompt" in payload:
        return "completions", payload
    return pooling_view(payload)
