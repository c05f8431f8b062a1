"""Structured output and forced tool calls: even a random model produces valid documents."""

from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import pytest
from openai import OpenAI

from tests.helpers.server import RunningServer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 6}}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 16},
                                      "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                           "b": {"type": "integer", "minimum": -99, "maximum": 99}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HI = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> OpenAI:
    return OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_is_always_satisfied_over_20_seeds(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    def one(seed: int) -> str:
        r = client.chat.completions.create(model="tiny", messages=HI, temperature=1.0, seed=seed,
                                           max_tokens=200, response_format=fmt)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    with cf.ThreadPoolExecutor(8) as pool:
        docs = list(pool.map(one, range(20)))
    for doc in docs:
        jsonschema.validate(json.loads(doc), PERSON)
    assert len(set(docs)) > 10  # sampled, not a constant


def test_json_object_mode_gives_an_object(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=300, seed=3,
                                       temperature=0.7, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # an unbounded object may run out of tokens; what exists must be a prefix
        assert (r.choices[0].message.content or "").startswith("{")


def test_required_tool_choice_always_yields_a_valid_call_over_20_seeds(client: OpenAI) -> None:
    def one(seed: int) -> tuple[str, dict]:
        r = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice="required", temperature=1.0, seed=seed,
                                           max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        (call,) = choice.message.tool_calls or []
        return call.function.name, json.loads(call.function.arguments)

    with cf.ThreadPoolExecutor(8) as pool:
        calls = list(pool.map(one, range(20)))
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


def test_named_tool_choice_calls_that_function(client: OpenAI) -> None:
    for seed in range(5):
        r = client.chat.completions.create(
            model="tiny", messages=HI, tools=TOOLS, seed=seed, temperature=1.0,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=100)
        (call,) = r.choices[0].message.tool_calls or []
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
        assert call.id.startswith("call_")


def test_forced_tool_call_streams_as_tool_call_deltas(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=HI, tools=TOOLS, tool_choice="required", stream=True,  # type: ignore[arg-type]
        max_tokens=200, seed=1, temperature=1.0)
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == ""  # no raw markup leaks into content
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name in SCHEMAS


def test_regex_extension(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=20,
                                       extra_body={"regex": "[0-9]{3}-[a-z]{2}"})
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content or "")


def test_lark_grammar_extension(client: OpenAI) -> None:
    grammar = 'start: "yes" | "no" | "maybe"'
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, seed=seed,
                                           temperature=1.0, extra_body={"grammar": grammar})
        assert r.choices[0].message.content in ("yes", "no", "maybe")


def test_constrained_and_free_requests_share_a_batch(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    free = dict(model="tiny", messages=HI, max_tokens=30, temperature=0)

    def constrained(seed: int) -> dict:
        r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=200, seed=seed,
                                           temperature=1.0, response_format=fmt)  # type: ignore[arg-type]
        return json.loads(r.choices[0].message.content or "")

    alone = client.chat.completions.create(**free).choices[0].message.content  # type: ignore[call-overload]
    with cf.ThreadPoolExecutor(6) as pool:
        docs = [pool.submit(constrained, s) for s in range(3)]
        frees = [pool.submit(client.chat.completions.create, **free) for _ in range(3)]
        for d in docs:
            jsonschema.validate(d.result(), PERSON)
        assert {f.result().choices[0].message.content for f in frees} == {alone}


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_answers_a_json_schema_request_with_valid_json(
        smollm2_server: RunningServer) -> None:
    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "country": {"type": "string", "maxLength": 40}}}
    r = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON "
                                              "with the keys city and country."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "capital", "schema": schema, "strict": True}})
    doc = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(doc, schema)
    assert "Paris" in doc["city"]


def test_forced_call_works_when_the_markers_are_added_tokens(agent_model, test_home) -> None:
    """Qwen-style tokenizers make <tool_call> one added token; the grammar must use its id."""
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(model=str(agent_model), served_model_name="m", home=test_home, no_starter=True)
    with running_server(cfg) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for seed in range(5):
            r = client.chat.completions.create(model="m", messages=HI, tools=TOOLS,  # type: ignore[arg-type]
                                               tool_choice="required", seed=seed,
                                               temperature=1.0, max_tokens=120)
            assert r.choices[0].finish_reason == "tool_calls"
            (call,) = r.choices[0].message.tool_calls or []
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
