"""Inputs no model can use (empty content, nulls in token lists, lone surrogates, schemas
that nest too deep or admit no finite value) are 400s naming the problem, in each API's
own error shape, never 500s or a 200 with nothing in it (issue 16 item 7)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mlxd.generation.schema_limits import MAX_SCHEMA_DEPTH, admits_finite_value, schema_depth
from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "hi"}]
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
REQUIRED_SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
NON_EMPTY_SELF_ARRAY = {"$ref": "#/$defs/a", "$defs": {"a": {
    "type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}}


@pytest.fixture(scope="module")
def http(mixed_server: RunningServer) -> httpx.Client:
    return mixed_server.client()


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a body written by hand (escapes such as ``\\ud800`` reach the server as sent)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def error_message(r: httpx.Response, status: int = 400) -> str:
    """The message of an error in the shape of the API at ``r``'s path."""
    assert r.status_code == status, r.text
    body = r.json()
    if r.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return str(body["error"]["message"])
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return str(body["error"]["message"])


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_message_with_empty_content_list_is_400(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={"model": "tiny", "max_tokens": 3,
                              "messages": [{"role": "user", "content": []}]})
    assert "non-empty content" in error_message(r)


def test_final_assistant_turn_may_be_empty(http: httpx.Client) -> None:
    r = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [
        *HI, {"role": "assistant", "content": []}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value, where", [([[None]], "input[0][0]"),
                                          ([[1, None]], "input[0][1]")])
def test_embedding_token_list_with_null_is_400(http: httpx.Client, value: Any,
                                               where: str) -> None:
    r = http.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": value})
    assert where in error_message(r)


LONE_SURROGATE = [
    ("/v1/chat/completions",
     '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model":"tiny","max_tokens":2,"prompt":"\\udfff"}', "prompt"),
    ("/v1/responses", '{"model":"tiny","max_output_tokens":2,"input":"x\\ud83d"}', "input"),
    ("/v1/messages",
     '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"\\ud800"}]}',
     "messages[0].content"),
    ("/v1/messages/count_tokens",
     '{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"\\ude00"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/embeddings", '{"model":"all-minilm-l6-v2","input":["ok","\\ud800"]}', "input[1]"),
    ("/v1/rerank", '{"model":"rerank","query":"\\ud800","documents":["a"]}', "query"),
    ("/v1/chat/completions",
     '{"model":"tiny","messages":[{"role":"user","content":"hi"}],"logit_bias":{"\\ud800":1}}',
     "logit_bias"),
]


@pytest.mark.parametrize("path, body, where", LONE_SURROGATE,
                         ids=[f"{p}:{w}" for p, _, w in LONE_SURROGATE])
def test_lone_surrogate_is_400_naming_the_field(http: httpx.Client, path: str, body: str,
                                                where: str) -> None:
    message = error_message(post_raw(http, path, body))
    assert "surrogate" in message and where in message


def test_escaped_surrogate_pair_is_a_valid_character(http: httpx.Client) -> None:
    r = post_raw(http, "/v1/messages/count_tokens",
                 '{"model":"tiny","messages":[{"role":"user","content":"hi \\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text


def _nested_any_of(levels: int) -> str:
    schema = '{"type":"string"}'
    for _ in range(levels):
        schema = '{"anyOf":[' + schema + ',{"type":"integer"}]}'
    return schema


def _chat_with_schema(schema_json: str) -> str:
    return ('{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"hi"}],'
            '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":'
            + schema_json + '}}}')


@pytest.mark.parametrize("levels", [100, 500])
def test_deeply_nested_any_of_schema_is_400(http: httpx.Client, levels: int) -> None:
    r = post_raw(http, "/v1/chat/completions", _chat_with_schema(_nested_any_of(levels)))
    assert "nests deeper than" in error_message(r)


def _ref_chain(hops: int) -> dict[str, Any]:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]}
            for i in range(hops)}
    defs[f"d{hops}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("hops", [500, 3000])
def test_long_ref_chain_schema_is_400_before_the_grammar_compiler(http: httpx.Client,
                                                                   hops: int) -> None:
    # 3000 hops overflowed llguidance's native stack and killed the process.
    r = post_raw(http, "/v1/chat/completions", _chat_with_schema(json.dumps(_ref_chain(hops))))
    message = error_message(r)
    assert "response_format" in message and f"deeper than {MAX_SCHEMA_DEPTH}" in message
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("schema", [CYCLE, REQUIRED_SELF, NON_EMPTY_SELF_ARRAY],
                         ids=["ref-cycle", "required-self", "non-empty-self-array"])
def test_schema_no_finite_value_satisfies_is_400(http: httpx.Client,
                                                 schema: dict[str, Any]) -> None:
    r = post_raw(http, "/v1/chat/completions", _chat_with_schema(json.dumps(schema)))
    assert "never be satisfied" in error_message(r)


def test_unsatisfiable_anthropic_output_format_and_tool_schema_are_400(
        http: httpx.Client) -> None:
    base = {"model": "tiny", "max_tokens": 3, "messages": HI}
    r = http.post("/v1/messages", json={**base, "output_config": {
        "format": {"type": "json_schema", "schema": REQUIRED_SELF}}})
    assert "output_config.format.schema" in error_message(r)
    r = http.post("/v1/messages", json={**base, "tools": [
        {"name": "t", "input_schema": REQUIRED_SELF}]})
    assert "tools[0].input_schema" in error_message(r)


def test_recursive_schema_with_a_way_out_still_generates(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    r = post_raw(http, "/v1/chat/completions", _chat_with_schema(json.dumps(schema)))
    assert r.status_code == 200, r.text


def test_body_nested_past_the_limit_is_400(http: httpx.Client) -> None:
    deep = "[" * 300 + "]" * 300
    r = post_raw(http, "/v1/chat/completions",
                 '{"model":"tiny","messages":[{"role":"user","content":"hi"}],"x":' + deep + "}")
    assert "nests deeper than" in error_message(r)
    deeper = "[" * 5000 + "]" * 5000  # past Python's own parser recursion limit
    r = post_raw(http, "/v1/embeddings", '{"model":"all-minilm-l6-v2","input":' + deeper + "}")
    assert "nests deeper than" in error_message(r)


@pytest.mark.parametrize("schema, finite", [
    (CYCLE, False), (REQUIRED_SELF, False), (NON_EMPTY_SELF_ARRAY, False),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}, False),
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                      "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                      "required": ["a"]}}, "$ref": "#/$defs/a"}, False),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, True),
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
      "required": ["kids"]}, True),
    ({}, True),
])
def test_finite_value_analysis(schema: dict[str, Any], finite: bool) -> None:
    assert admits_finite_value(schema) is finite


def test_schema_depth_counts_ref_hops_and_survives_cycles() -> None:
    assert schema_depth(_ref_chain(300)) > 300
    assert schema_depth(CYCLE) < 10


@pytest.mark.parametrize("source", ["~no-such-user-mlxd/model", "x" * 5000])
def test_put_model_with_an_unusable_path_is_400(http: httpx.Client, source: str) -> None:
    # Path("~user").expanduser() raises RuntimeError; a 5000-byte name, ENAMETOOLONG.
    r = http.put("/v1/models", json={"name": "unusable-path", "source": source})
    assert "not a usable path" in error_message(r)
    assert http.get("/v1/models/unusable-path").status_code == 404
