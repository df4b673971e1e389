"""The model the gateway in front names for a request, in place of the one its body asks for.

The Inference Extension's ``x-gateway-model-name-rewrite`` header (or llm-d's name for it,
``picker.names``) lets the gateway send a request to another model or adapter (a canary, a LoRA)
without the client knowing: the picker writes the name into the JSON body before anything reads
it, so dispatch, the instance and the usage all see the rewritten model. An upload's form keeps its
own model.
"""

from __future__ import annotations

import re

from taogate.errors import BadRequest
from taogate.picker.encoding import Headers
from taogate.picker.names import MODEL_REWRITE, first_header

__all__ = ["rewritten_model"]

#: A model name as vLLM serves one (``--served-model-name``, a Hugging Face id, an adapter's name).
_NAME = re.compile(rb"[\x21-\x7e]{1,256}")


def rewritten_model(headers: Headers) -> str | None:
    """The model the header names, or None without one; a malformed name is a 400."""
    found = first_header(headers, MODEL_REWRITE)
    if found is None:
        return None
    name, value = found[0], found[1].strip()
    if _NAME.fullmatch(value) is None:
        raise BadRequest(
            f"The {name.decode()} header must name a model: 1-256 visible ASCII characters.",
            code="invalid_model",
            param="model",
        )
    return value.decode("ascii")
