"""The 404 advice: the base_url to set, unless the client is already under the API's base; and the
shape of errors at paths no route serves."""

from __future__ import annotations

import orjson

from taogate.app import unknown_path_message
from taogate.errors import OPENAI_ERRORS
from taogate.proxy.anthropic import ANTHROPIC_ERRORS
from taogate.proxy.routes import error_shapes


def test_a_client_under_v1_gets_the_routes_not_a_base_url() -> None:
    for path, prefix in (("/v1/nope", ""), ("/v1", ""), ("/api/v1/chat/complete", "/api")):
        message = unknown_path_message(path, prefix, "http://gw:8080/api")
        assert "base_url" not in message and "POST /v1/chat/completions" in message, message
    assert "(and the same under /api/v1)" in unknown_path_message("/api/v1/x", "/api", "http://gw:8080/api")


def test_a_client_outside_the_api_is_told_its_base_url() -> None:
    message = unknown_path_message("/chat/completions", "/api", "http://gw:8080/api")
    assert "set your client's base_url to http://gw:8080/api/v1" in message
    assert "/v1 and /api/v1" in message


def test_a_path_under_the_messages_api_errs_in_anthropic_s_shape_any_other_in_openai_s() -> None:
    shape_at = error_shapes("/api")
    anthropic_paths = ("/v1/messages", "/v1/messages/batches", "/api/v1/messages/count_tokens/x")
    for path in anthropic_paths:
        assert shape_at(path) is ANTHROPIC_ERRORS, path
    for path in ("/v1/messagesx", "/v1/chat/completions", "/api/v1/models", "/x/v1/messages", ""):
        assert shape_at(path) is OPENAI_ERRORS, path
    assert error_shapes("")("/api/v1/messages") is OPENAI_ERRORS  # no prefix: not under the API
    body = orjson.loads(ANTHROPIC_ERRORS.refusal(431, "header_too_large", "too large"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "too large"}}
    body = orjson.loads(OPENAI_ERRORS.refusal(408, "header_timeout", "slow"))
    assert body["error"]["code"] == "header_timeout" and body["error"]["type"] == "invalid_request_error"
