"""A request's output limit, as a key's token limit reserves it: the field each API names it by,
the first not null, and a negative one refused."""

from __future__ import annotations

from typing import Any

import pytest

from taogate.errors import BadRequest
from taogate.proxy.intake import output_limit


@pytest.mark.parametrize(
    ("payload", "limit"),
    [
        ({"max_tokens": 40}, 40),
        ({"max_completion_tokens": 30, "max_tokens": 40}, 30),
        ({"max_completion_tokens": None, "max_tokens": 40}, 40),  # null is not set
        ({"max_output_tokens": 50}, 50),  # the Responses API
        ({"max_tokens": 0}, 0),
        ({"max_tokens": "40"}, None),  # the engine answers a wrong type itself
        ({"max_tokens": True}, None),
        ({}, None),
    ],
)
def test_the_output_limit_is_read_from_the_field_in_use(payload: dict[str, Any], limit: int | None) -> None:
    assert output_limit(payload) == limit


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_a_negative_output_limit_is_a_400_naming_its_field(name: str) -> None:
    with pytest.raises(BadRequest) as refused:
        output_limit({name: -(10**15)})
    assert refused.value.param == name and name in refused.value.message
