"""Render every error in the shape of the API the client speaks.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``.
Ollama (``/api/*``): ``{"error": "message"}``.
Validation errors and malformed JSON are 400s; nothing a client sends
produces a 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from mlxd.errors import MlxdError, validation_text

log = logging.getLogger(__name__)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    409: "invalid_request_error", 422: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    507: "invalid_request_error", 500: "api_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
                 503: "overloaded_error", 507: "insufficient_storage", 500: "server_error"}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "api_error")


def is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def is_ollama(path: str) -> bool:
    """Ollama's native API answers errors as ``{"error": "message"}``."""
    return path.startswith("/api/")


def error_body(request: Request, status: int, message: str, *, error_type: str | None = None,
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    if is_ollama(request.url.path):
        return {"error": message}
    if is_anthropic(request):
        return {"type": "error",
                "error": {"type": anthropic_error_type(status), "message": message}}
    return {"error": {"message": message,
                      "type": error_type or _OPENAI_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(request: Request, status: int, message: str, *,
                   headers: dict[str, str] | None = None, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(request, status, message, **kw), status_code=status,
                        headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    scope = {**request.scope, "method": "\0"}  # no route serves it: a partial match each
    methods: set[str] = set()
    routes = list(request.app.router.routes)
    while routes:
        route = routes.pop()
        included = getattr(route, "original_router", None)  # FastAPI keeps routers nested
        if included is not None:
            routes.extend(included.routes)
        elif getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= set(route.methods)
    return sorted(methods)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"Request body is not valid JSON: {ctx.get('error', 'parse error')}", None
    parts = []
    param = None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        parts.append(f"{where}: {validation_text(err)}")
    return "Invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MlxdError)
    async def _mlxd(request: Request, exc: MlxdError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 503 and exc.status != 507:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(request, exc.status, exc.message, error_type=exc.error_type,
                              param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request, 400, message, param=param)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(request, 400, f"Request body is not valid JSON: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = allowed_methods(request)
            message = (f"Method {request.method} is not allowed on {request.url.path}; "
                       f"allowed: {', '.join(allowed)}.")
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return error_response(request, exc.status_code, message, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # the client left (or was cut off by --body-timeout) mid-body: not a server error, and
        # logging a traceback for each would let slow clients flood the log
        log.debug("client disconnected during %s %s", request.method, request.url.path)
        return error_response(request, 400, "Client disconnected before sending the whole "
                                            "request body.")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        # sent outside RequestObserver (Starlette's outermost layer): add its header here
        request_id = request.scope.get("state", {}).get("request_id")
        return error_response(request, 500, f"Internal error: {type(exc).__name__}: {exc}",
                              error_type="server_error",
                              headers={"X-Request-Id": request_id} if request_id else None)
