"""Every bad input gets a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer) -> httpx.Client:
    return tiny_server.client()


def assert_openai_error(r: httpx.Response, status: int, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert contains.lower() in err["message"].lower()
    return err


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "not valid JSON")


def test_wrong_types(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": "hello"})
    err = assert_openai_error(r, 400, "messages")
    assert err["type"] == "invalid_request_error"


def test_missing_model(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": HI}), 400, "model")


def test_empty_messages(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert_openai_error(r, 400, "at least one message")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": HI})
    err = assert_openai_error(r, 404, "no-such-model")
    assert err["code"] == "model_not_found"


def test_prompt_alone_over_context(http: httpx.Client) -> None:
    long = " ".join(["word"] * 5000)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": long, "max_tokens": 1})
    assert_openai_error(r, 400, "maximum context length")


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("n", 0), ("max_tokens", 0),
    ("top_logprobs", 21), ("presence_penalty", 3), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"5": 1000}), ("stop", 5),
])
def test_out_of_range_fields(http: httpx.Client, field: str, value: object) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, field: value})
    err = assert_openai_error(r, 400)
    assert field in (err["param"] or "") or field in err["message"]


def test_top_logprobs_without_logprobs(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions",
                  json={"model": "tiny", "messages": HI, "top_logprobs": 2})
    assert_openai_error(r, 400, "logprobs")


def test_n_above_the_limit(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "n": 100})
    assert_openai_error(r, 400, "n must be at most")


def test_bad_role(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions",
                  json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]})
    assert_openai_error(r, 400, "role")


def test_image_part_for_a_text_model(http: httpx.Client) -> None:
    msg = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msg})
    assert_openai_error(r, 400, "text model")


def test_token_ids_out_of_vocabulary(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 10**9]})
    assert_openai_error(r, 400, "token ids")


def test_tool_choice_naming_a_missing_tool(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": HI, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "b"}}})
    assert_openai_error(r, 400, "not in tools")


def test_tool_without_name(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"parameters": {"type": "object"}}}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "tools": tools})
    assert_openai_error(r, 400, "name")


def test_invalid_json_schema(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": HI,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "objectt"}}}})
    assert_openai_error(r, 400, "Invalid JSON schema")


def test_invalid_grammar_and_regex(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions",
                  json={"model": "tiny", "messages": HI, "grammar": "start: undefined_rule"})
    assert_openai_error(r, 400, "Invalid constraint")
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "regex": "(("})
    assert_openai_error(r, 400, "regex")


def test_unknown_route_is_404_in_shape(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404, "No route")


def test_wrong_method(http: httpx.Client) -> None:
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "error" in r.json()


def test_bad_input_changes_nothing(http: httpx.Client, tiny_server: RunningServer) -> None:
    before = tiny_server.ctx.manager.get("tiny").loads
    http.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert tiny_server.ctx.manager.get("tiny").loads == before
