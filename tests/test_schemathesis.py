"""Schemathesis against the server's own /openapi.json: no input gives a 5xx, and every
answer matches the document (status, content type, body schema).

A bounded run on a real server (127.0.0.1) with a model of each family. Valid model
names are patched into ``model`` fields and ``max_tokens``/``n`` are capped, so the run
exercises the requests rather than 404s and long generations. Reproduce a failure with
the printed seed: ``MLXD_SCHEMATHESIS_SEED=<seed> pytest tests/test_schemathesis.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mlxd.config import ServerConfig
from mlxd.server.app import build_app
from tests.helpers.server import RunningServer

SEED = int(os.environ.get("MLXD_SCHEMATHESIS_SEED", "20261601"))
EXAMPLES = int(os.environ.get("MLXD_SCHEMATHESIS_EXAMPLES", "40"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]

MODEL_FOR_PATH = {"/v1/embeddings": "all-minilm-l6-v2", "/v1/rerank": "rerank",
                  "/api/embed": "all-minilm-l6-v2", "/api/embeddings": "all-minilm-l6-v2",
                  "/rerank": "rerank", "/v2/rerank": "rerank", "/tokenize": "tiny",
                  "/detokenize": "tiny"}
TOKEN_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2,
              "best_of": 2}
LIMIT_FOR_PATH = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                  "/v1/responses": "max_output_tokens"}
# Admin routes that change what the server serves get names of their own, so the fuzzer
# never replaces or deletes the models the rest of the run needs.
FUZZ_PREFIX = "fuzz-"
OWN_NAMES = {"/api/delete", "/api/pull"}  # Ollama's delete, and pull (a name or a source)


def patch_body(path: str, body: Any) -> Any:
    """A known model name for ``model``, small generation limits, and a message where the
    generated conversation is empty (so more cases reach generation; only on objects)."""
    if not isinstance(body, dict):
        return body
    if path == "/v1/models" and isinstance(body.get("name"), str):
        body["name"] = FUZZ_PREFIX + body["name"]
    if path in OWN_NAMES:
        for key in ("model", "name"):
            if isinstance(body.get(key), str):
                body[key] = FUZZ_PREFIX + body[key]
    elif "model" in body and path != "/v1/models/unload":
        body["model"] = MODEL_FOR_PATH.get(path, "tiny")
    for key in ("messages", "input"):
        if body.get(key) == [] and path != "/v1/embeddings":
            body[key] = [{"role": "user", "content": "hi"}]
    for key, cap in TOKEN_CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if path in ("/api/chat", "/api/generate") and isinstance(body.get("options") or {}, dict):
        options = dict(body.get("options") or {})  # Ollama's default: up to the context's end
        value = options.get("num_predict")
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 4):
            options["num_predict"] = 4
        body["options"] = options
    # no limit means the rest of the context: set one, so the run stays short
    limit = LIMIT_FOR_PATH.get(path)
    if limit is not None and not any(k in body for k in TOKEN_CAPS if k != "n"):
        body[limit] = TOKEN_CAPS[limit]
    return body


def _operations() -> list[tuple[str, str]]:
    """Every documented operation (of a default app's document;
    ``test_every_served_operation_is_fuzzed`` checks the server serves the same)."""
    doc = build_app(ServerConfig()).openapi()
    return [(method.upper(), path) for path, ops in doc["paths"].items() for method in ops]


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def api_schema(mixed_server: RunningServer) -> Any:
    print(f"\nschemathesis seed: {SEED} (MLXD_SCHEMATHESIS_SEED), "
          f"{EXAMPLES} examples per operation")
    schema = schemathesis.openapi.from_url(mixed_server.url + "/openapi.json")

    @schema.hook("map_body")
    def _known_models(context: Any, body: Any) -> Any:
        return patch_body(context.operation.path, body)

    @schema.hook("map_path_parameters")
    def _own_names(context: Any, parameters: dict[str, Any]) -> dict[str, Any]:
        if context.operation.method.upper() == "DELETE" and "name" in (parameters or {}):
            parameters["name"] = FUZZ_PREFIX + str(parameters["name"])
        return parameters

    return schema


def test_every_served_operation_is_fuzzed(mixed_server: RunningServer) -> None:
    served = mixed_server.client().get("/openapi.json").json()["paths"]
    assert {(m.upper(), p) for p, ops in served.items() for m in ops} == set(OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_5xx_and_answers_match_the_openapi_document(
        api_schema: Any, mixed_server: RunningServer, method: str, path: str) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @hypothesis_seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(case=cases)
    def fuzz(case: Any) -> None:
        case.call_and_validate(base_url=mixed_server.url, checks=CHECKS, timeout=120)

    fuzz()
