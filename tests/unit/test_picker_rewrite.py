"""The Inference Extension's model rewrite header, and llm-d's names for it, read (pure, no I/O)."""

from __future__ import annotations

import pytest

from taogate.errors import BadRequest
from taogate.picker.names import MODEL_REWRITE
from taogate.picker.rewrite import rewritten_model

GIE = MODEL_REWRITE[0]


def test_the_header_names_the_model_or_nothing() -> None:
    assert rewritten_model([(b"content-type", b"application/json")]) is None
    assert rewritten_model([(GIE, b"meta-llama/Llama-3.1-8B-Instruct")]) == (
        "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert rewritten_model([(GIE, b" sql-lora ")]) == "sql-lora"


@pytest.mark.parametrize("value", [b"", b"two words", "modèle".encode(), b"m" * 257, b"a\x00b"])
def test_a_malformed_name_is_a_400(value: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        rewritten_model([(GIE, value)])
    assert refused.value.code == "invalid_model" and refused.value.status == 400


def test_llm_ds_names_are_read_too_the_inference_extensions_first() -> None:
    assert rewritten_model([(b"x-llm-d-router-model-name-rewrite", b"canary")]) == "canary"
    assert rewritten_model([(b"x-llm-d-model-name-rewrite", b"canary")]) == "canary"
    both = [(b"x-llm-d-router-model-name-rewrite", b"theirs"), (GIE, b"ours")]
    assert rewritten_model(both) == "ours"
    with pytest.raises(BadRequest) as refused:
        rewritten_model([(b"x-llm-d-model-name-rewrite", b"two words")])
    assert "The x-llm-d-model-name-rewrite header must name a model" in refused.value.message
