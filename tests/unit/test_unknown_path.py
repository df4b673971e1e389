"""The 404 advice: the base_url to set, unless the client is already under the API's base."""

from __future__ import annotations

from taogate.app import unknown_path_message


def test_a_client_under_v1_gets_the_routes_not_a_base_url() -> None:
    for path, prefix in (("/v1/nope", ""), ("/v1", ""), ("/api/v1/chat/complete", "/api")):
        message = unknown_path_message(path, prefix, "http://gw:8080/api")
        assert "base_url" not in message and "POST /v1/chat/completions" in message, message
    assert "(and the same under /api/v1)" in unknown_path_message("/api/v1/x", "/api", "http://gw:8080/api")


def test_a_client_outside_the_api_is_told_its_base_url() -> None:
    message = unknown_path_message("/chat/completions", "/api", "http://gw:8080/api")
    assert "set your client's base_url to http://gw:8080/api/v1" in message
    assert "/v1 and /api/v1" in message
