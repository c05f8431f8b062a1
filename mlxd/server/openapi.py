"""The OpenAPI document describes what this server does, not FastAPI's defaults.

FastAPI documents a 422 we never send and knows nothing of our error bodies,
streaming content types or configured limits. ``install_openapi`` builds the
document once and then:

* replaces 422 by the statuses each route really answers (400, 401, 403, 404,
  409, 413, 500, 503, 507), each with its body schema: OpenAI's ``error``
  object, Anthropic's ``{"type": "error"}`` on ``/v1/messages``, Ollama's
  ``{"error": "..."}`` on ``/api/*``;
* adds ``text/event-stream`` to the streaming routes (``application/x-ndjson`` to
  Ollama's) and Prometheus text to
  ``/metrics``;
* writes the server's configured limits (``--max-n``, ``--max-rerank-documents``)
  into the request schemas (an embedding ``input`` list may be one token list, so
  ``--max-embedding-inputs`` is not a ``maxItems``).

A 405 is not listed per operation (no operation answers 405 to its own
method); it carries an ``Allow`` header naming the methods the path has.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from mlxd.config import ServerConfig

OPENAI_ERROR = "OpenAIError"
ANTHROPIC_ERROR = "AnthropicError"
OLLAMA_ERROR = "OllamaError"

_ERROR_SCHEMAS: dict[str, Any] = {
    OPENAI_ERROR: {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
    ANTHROPIC_ERROR: {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
    OLLAMA_ERROR: {"type": "object", "required": ["error"],
                   "properties": {"error": {"type": "string"}}},
}

# OpenAPI 3.1 (before ``itemSchema``): the ``schema`` of an event stream is one event.
# ``data`` is JSON but for OpenAI's closing ``[DONE]``, so it stays a string here.
SSE_EVENT: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "description": "One server-sent event (``stream: true``): a JSON ``data`` payload in "
                   "the API's chunk or event shape, named by ``event`` on the Anthropic and "
                   "Responses APIs",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}

_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, a wrong type or value, wrong model kind, "
         "prompt over the context...)",
    401: "Missing or invalid API key", 403: "This admin route needs the admin API key",
    404: "No such model or object", 409: "The model is in use or already registered",
    413: "Request body over --max-body-bytes (an audio upload: over "
         "--max-audio-upload-bytes)",
    500: "The model failed to load or generation failed inside the engine",
    503: "No capacity now (queue full, memory budget held, shutting down); see Retry-After",
    507: "The model can never fit in the memory budget",
}

# Statuses per kind of route, beyond 401/403 (which depend on the configured keys).
_MODEL_CALL = (400, 404, 413, 500, 503, 507)
_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("get", "/v1/models/{name}"): (404,),
    ("delete", "/v1/models/{name}"): (404, 409),
    ("put", "/v1/models"): (400, 409, 413),
    ("post", "/v1/models/load"): _MODEL_CALL,
    ("post", "/v1/models/unload"): (400, 404, 409, 413),
    ("get", "/v1/responses/{response_id}"): (404,),
    ("delete", "/v1/responses/{response_id}"): (404,),
    ("get", "/tokenizer_info"): (400, 404, 500, 503, 507),
    ("get", "/v1/audio/voices"): (400, 404),
    ("post", "/api/show"): (400, 404, 413),
    ("delete", "/api/delete"): (400, 404, 409, 413),
    ("post", "/api/pull"): (400, 409, 413),
}
_MODEL_CALLS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/rerank",
                "/v2/rerank", "/tokenize", "/detokenize", "/v1/audio/transcriptions",
                "/v1/audio/translations", "/v1/audio/speech", "/api/chat", "/api/generate",
                "/api/embed", "/api/embeddings"}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
             "/v1/audio/transcriptions", "/v1/audio/speech"}
NDJSON_STREAMING = {"/api/chat", "/api/generate", "/api/pull"}  # Ollama: one JSON per line
PUBLIC = {"/health", "/healthz"}
ADMIN = {("post", "/v1/models/load"), ("post", "/v1/models/unload"), ("put", "/v1/models"),
         ("delete", "/v1/models/{name}"), ("post", "/api/pull"), ("delete", "/api/delete")}


def _statuses(method: str, path: str, config: ServerConfig) -> list[int]:
    found = set(_STATUSES.get((method, path), _MODEL_CALL if path in _MODEL_CALLS else ()))
    if path not in PUBLIC:
        found.add(503)  # every route while the server drains on SIGTERM (server/drain.py)
        if config.api_key or (config.admin_api_key and (method, path) in ADMIN):
            found.add(401)
        if config.admin_api_key and (method, path) in ADMIN:
            found.add(403)
    return sorted(found)


def _error_response(status: int, path: str) -> dict[str, Any]:
    name = (ANTHROPIC_ERROR if path.startswith("/v1/messages") else
            OLLAMA_ERROR if path.startswith("/api/") else OPENAI_ERROR)
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
    if status == 503:
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                               "description": "Seconds to wait"}}
    return response


def _set_maximum(schemas: dict[str, Any], model: str, field: str, key: str,
                 value: int) -> None:
    """Set ``key`` (maximum / maxItems) on ``model.field`` and on its non-null variants."""
    prop = schemas.get(model, {}).get("properties", {}).get(field)
    if prop is None:
        return
    targets = [v for v in prop.get("anyOf", []) if v.get("type") not in (None, "null", "string")]
    for target in targets or [prop]:
        target[key] = value


def _apply_limits(schemas: dict[str, Any], config: ServerConfig) -> None:
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        _set_maximum(schemas, model, "n", "maximum", config.max_n)
    _set_maximum(schemas, "RerankRequest", "documents", "maxItems", config.max_rerank_documents)
    _set_maximum(schemas, "SpeechCreateRequest", "input", "maxLength",
                 config.max_speech_input_chars)


def _fix_operation(method: str, path: str, op: dict[str, Any], config: ServerConfig) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    for status in _statuses(method, path, config):
        responses[str(status)] = _error_response(status, path)
    ok = responses.get("200", {}).setdefault("content", {})
    if path in STREAMING:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    if path in NDJSON_STREAMING:  # the schema of one line, as for an event stream
        ok["application/x-ndjson"] = {"schema": ok.get("application/json", {}).get("schema", {})}
    if path == "/health":  # the same body, "status": "draining", while shutting down
        responses["503"] = {"description": "Shutting down (draining); see Retry-After",
                            "content": ok, "headers": _error_response(503, path)["headers"]}
    if path == "/metrics":
        ok.clear()
        ok["text/plain"] = {"schema": {"type": "string",
                                       "description": "Prometheus text exposition format"}}


def build_openapi(app: FastAPI, config: ServerConfig) -> dict[str, Any]:
    """The document FastAPI would build, corrected as the module docstring says."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description=app.description)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(_ERROR_SCHEMAS)
    _apply_limits(schemas, config)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            _fix_operation(method, path, op, config)
    return doc


def install_openapi(app: FastAPI, config: ServerConfig) -> None:
    """Serve :func:`build_openapi`'s document at ``/openapi.json`` (built on first use)."""
    cache: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not cache:
            cache.append(build_openapi(app, config))
        return cache[0]

    app.openapi = openapi  # type: ignore[method-assign]
