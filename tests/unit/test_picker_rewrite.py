"""The Inference Extension's model rewrite header, read (pure, no I/O)."""

from __future__ import annotations

import pytest

from taogate.errors import BadRequest
from taogate.picker.rewrite import MODEL_REWRITE, rewritten_model


def test_the_header_names_the_model_or_nothing() -> None:
    assert rewritten_model([(b"content-type", b"application/json")]) is None
    assert rewritten_model([(MODEL_REWRITE, b"meta-llama/Llama-3.1-8B-Instruct")]) == (
        "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert rewritten_model([(MODEL_REWRITE, b" sql-lora ")]) == "sql-lora"


@pytest.mark.parametrize("value", [b"", b"two words", "modèle".encode(), b"m" * 257, b"a\x00b"])
def test_a_malformed_name_is_a_400(value: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        rewritten_model([(MODEL_REWRITE, value)])
    assert refused.value.code == "invalid_model" and refused.value.status == 400
