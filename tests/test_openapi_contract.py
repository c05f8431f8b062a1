"""The OpenAPI document says what the server does, and the server keeps to it
(issue 16 item 9): declared error statuses and bodies, content types, limits, strict
types, 405s with the right ``Allow``, and Anthropic errors in Anthropic's words."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mlxd.config import ServerConfig
from mlxd.server.app import build_app
from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "hi"}]
ERROR_REF = "#/components/schemas/{}"


@pytest.fixture(scope="module")
def http(mixed_server: RunningServer) -> httpx.Client:
    return mixed_server.client()


@pytest.fixture(scope="module")
def doc(http: httpx.Client) -> dict[str, Any]:
    return dict(http.get("/openapi.json").json())


def _error_schema(op: dict[str, Any], status: int) -> str:
    return str(op["responses"][str(status)]["content"]["application/json"]["schema"]["$ref"])


def test_no_route_documents_a_422_the_server_never_sends(doc: dict[str, Any]) -> None:
    statuses = {s for ops in doc["paths"].values() for op in ops.values() for s in op["responses"]}
    assert "422" not in statuses
    assert "HTTPValidationError" not in doc["components"]["schemas"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/v1/embeddings", "/v1/rerank", "/v1/messages"])
def test_model_routes_declare_their_errors_in_their_api_shape(doc: dict[str, Any],
                                                              path: str) -> None:
    op = doc["paths"][path]["post"]
    shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
    for status in (400, 404, 413, 503, 507):
        assert _error_schema(op, status) == ERROR_REF.format(shape)
    assert "Retry-After" in op["responses"]["503"]["headers"]


def test_lookups_declare_404(doc: dict[str, Any]) -> None:
    assert "404" in doc["paths"]["/v1/models/{name}"]["get"]["responses"]
    assert "404" in doc["paths"]["/v1/responses/{response_id}"]["delete"]["responses"]
    health = doc["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"}  # 503: draining on SIGTERM, with the same body
    assert health["503"]["content"] == health["200"]["content"]
    assert "Retry-After" in health["503"]["headers"]


def test_streaming_routes_and_metrics_declare_their_content_types(doc: dict[str, Any],
                                                                  http: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_auth_statuses_are_declared_only_when_keys_are_configured() -> None:
    open_doc = build_app(ServerConfig()).openapi()
    assert "401" not in open_doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    keyed = build_app(ServerConfig(api_key="k", admin_api_key="a")).openapi()
    assert "401" in keyed["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "403" in keyed["paths"]["/v1/models/load"]["post"]["responses"]
    assert "401" not in keyed["paths"]["/health"]["get"]["responses"]


def test_documented_n_limit_is_the_servers(doc: dict[str, Any], http: httpx.Client) -> None:
    limit = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["n"]["maximum"]
    assert limit == ServerConfig().max_n
    body = {"model": "tiny", "messages": HI, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json={**body, "n": limit}).status_code == 200
    r = http.post("/v1/chat/completions", json={**body, "n": limit + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.mark.parametrize("path, model, body", [
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": HI, "max_tokens": 1}),
    ("/v1/responses", "ResponsesRequest", {"input": "hi", "max_output_tokens": 1}),
])
def test_documented_stop_limit_is_the_servers(doc: dict[str, Any], http: httpx.Client,
                                              path: str, model: str,
                                              body: dict[str, Any]) -> None:
    variants = doc["components"]["schemas"][model]["properties"]["stop"]["anyOf"]
    limit = next(v["maxItems"] for v in variants if v.get("type") == "array")
    body = {"model": "tiny", **body}
    ok = http.post(path, json={**body, "stop": [f"s{i}" for i in range(limit)]})
    assert ok.status_code == 200, ok.text
    r = http.post(path, json={**body, "stop": [f"s{i}" for i in range(limit + 1)]})
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "frequency_penalty", True),
    ("/v1/chat/completions", "stream", 0),
    ("/v1/chat/completions", "temperature", "0.5"),
    ("/v1/chat/completions", "max_tokens", 2.5),
    ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/completions", "echo", 1),
    ("/v1/responses", "store", 0),
    ("/v1/messages", "stream", 1),
    ("/v1/messages", "thinking", {"type": "enabled", "budget_tokens": False}),
    ("/v1/embeddings", "dimensions", True),
    ("/v1/rerank", "top_n", True),
])
def test_values_of_the_wrong_json_type_are_400_not_coerced(http: httpx.Client, path: str,
                                                           field: str, value: Any) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"model": "tiny", "messages": HI, "max_tokens": 1},
        "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
        "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1},
        "/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": 1},
        "/v1/embeddings": {"model": "all-minilm-l6-v2", "input": "hi"},
        "/v1/rerank": {"model": "rerank", "query": "q", "documents": ["a"]},
    }
    r = http.post(path, json={**bodies[path], field: value})
    assert r.status_code == 400, r.text
    assert field in r.text


def test_integers_are_accepted_for_float_fields(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1,
                                                "temperature": 1, "top_p": 1,
                                                "frequency_penalty": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method, path, allowed", [
    ("DELETE", "/v1/models", "GET, PUT"),
    ("PATCH", "/v1/models/tiny", "DELETE, GET"),
    ("GET", "/v1/chat/completions", "POST"),
    ("GET", "/v1/messages", "POST"),
])
def test_405_names_every_method_the_path_serves(http: httpx.Client, method: str, path: str,
                                                allowed: str) -> None:
    r = http.request(method, path)
    assert r.status_code == 405
    assert r.headers["allow"] == allowed
    body = r.json()
    message = body["error"]["message"]
    assert allowed in message
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_anthropic_tool_choice_errors_say_any(http: httpx.Client) -> None:
    base = {"model": "tiny", "max_tokens": 2, "messages": HI}
    r = http.post("/v1/messages", json={**base, "tool_choice": {"type": "any"}})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "'any'" in message and "required" not in message
    tool = {"name": "get", "input_schema": {"type": "object", "properties": {}}}
    r = http.post("/v1/messages", json={**base, "tools": [tool], "tool_choice": {"type": "any"},
                                        "output_config": {"format": {
                                            "type": "json_schema", "schema": {"type": "object"}}}})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "'any'" in message and "response_format" not in message
