"""Log-probabilities are always finite JSON numbers (issue 16, item 6).

Constrained decoding masks tokens to ``-inf`` and an extreme repetition
penalty makes logits non-finite; JSON has neither ``-Infinity`` nor ``NaN``.
A token the sampled distribution rules out is reported at OpenAI's floor,
``-9999.0``, and the ``top_logprobs`` list keeps its requested length (masked
alternatives appear at the floor). Responses are parsed strictly here: Python's
``json`` (and so the SDKs) would silently accept ``-Infinity``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlxd.generation.events import LOGPROB_FLOOR, TokenLogprob, TopLogprob
from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "hi"}]
TOP = 20
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}

# Each case: (endpoint, extra body). All ask for logprobs with TOP alternatives.
CHAT_CASES: dict[str, dict[str, Any]] = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}}}},
    "regex": {"regex": "[0-9]{4}"},
    "tool_choice required": {"tools": [TOOL], "tool_choice": "required"},
    "tiny repetition_penalty": {"repetition_penalty": 5e-324},
}


def _reject(constant: str) -> Any:
    raise AssertionError(f"non-JSON constant {constant} on the wire")


def strict(text: str) -> Any:
    return json.loads(text, parse_constant=_reject)


def sse_payloads(r: httpx.Response) -> Iterator[Any]:
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield strict(line[len("data: "):])


def assert_reportable(value: float) -> None:
    assert isinstance(value, float | int)
    assert LOGPROB_FLOOR <= value <= 0.0


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client


def chat_body(extra: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": HI, "max_tokens": 6, "logprobs": True,
            "top_logprobs": TOP, "stream": stream, **extra}


def check_chat_entries(entries: list[dict[str, Any]]) -> list[float]:
    """Every value is reportable; returns all values seen."""
    values = []
    for entry in entries:
        assert_reportable(entry["logprob"])
        assert len(entry["top_logprobs"]) == TOP
        tops = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)  # most likely first, floor values last
        for alt in entry["top_logprobs"]:
            assert_reportable(alt["logprob"])
            values.append(alt["logprob"])
        values.append(entry["logprob"])
    return values


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_logprobs_are_finite_json(case: str, http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=chat_body(CHAT_CASES[case], stream=False))
    assert r.status_code == 200, r.text
    body = strict(r.text)
    entries = body["choices"][0]["logprobs"]["content"]
    assert entries
    values = check_chat_entries(entries)
    if case != "tiny repetition_penalty":
        # The grammar rules out most of the vocabulary: masked alternatives sit at the floor.
        assert LOGPROB_FLOOR in values


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_streamed_chat_logprobs_are_finite_json(case: str, http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=chat_body(CHAT_CASES[case], stream=True))
    entries = [e for p in sse_payloads(r) for c in p.get("choices", [])
               for e in (c.get("logprobs") or {}).get("content") or []]
    assert entries
    check_chat_entries(entries)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", [{"regex": "[a-z]{3}[0-9]{3}"}, {"repetition_penalty": 5e-324}],
                         ids=["regex", "tiny repetition_penalty"])
def test_completions_logprobs_are_finite_json(extra: dict[str, Any], stream: bool,
                                              http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 6,
                                           "logprobs": 5, "echo": not stream, "stream": stream,
                                           **extra})
    assert r.status_code == 200, r.text
    choices = ([c for p in sse_payloads(r) for c in p["choices"]] if stream
               else strict(r.text)["choices"])
    seen = 0
    for choice in choices:
        lps = choice["logprobs"] or {"token_logprobs": [], "top_logprobs": []}
        for value in lps["token_logprobs"]:
            if value is not None:
                assert_reportable(value)
                seen += 1
        for tops in lps["top_logprobs"]:
            for value in (tops or {}).values():
                assert_reportable(value)
    assert seen


@pytest.mark.parametrize("value", ["Infinity", "1e309"])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions",
                                      "/v1/responses"])
def test_repetition_penalty_must_be_finite(value: str, endpoint: str,
                                          http: httpx.Client) -> None:
    """Positive was already checked (``gt=0``, as vLLM); infinity is not a penalty."""
    body = {"model": "tiny", "max_tokens": 2, "repetition_penalty": "@"}
    body.update({"/v1/chat/completions": {"messages": HI}, "/v1/completions": {"prompt": "hi"},
                 "/v1/responses": {"input": "hi", "max_output_tokens": 2}}[endpoint])
    raw = json.dumps(body).replace('"@"', value)  # Python's json reads Infinity/NaN literals
    r = http.post(endpoint, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "repetition_penalty" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw", [float("-inf"), float("nan"), -1e300, float("inf"), 1e-3])
def test_logprob_events_are_clamped_to_the_reportable_range(raw: float) -> None:
    top = TopLogprob("a", raw, [97])
    token = TokenLogprob(1, "a", raw, [97], [top])
    expected = {1e-3: 0.0, float("inf"): 0.0}.get(raw, LOGPROB_FLOOR)
    assert top.logprob == token.logprob == expected
    assert TokenLogprob(1, "a", -0.5, [97]).logprob == -0.5
