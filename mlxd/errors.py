"""Errors every layer raises; the HTTP layer renders them in each API's shape.

Each error carries the HTTP status it maps to, so engines and the model
manager can refuse a request precisely without knowing about HTTP.
"""

from __future__ import annotations


class MlxdError(Exception):
    """Base error: a message for the client, an HTTP status and an OpenAI type."""

    status: int = 500
    error_type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class InvalidRequest(MlxdError):
    """The request is malformed or asks for something impossible (400)."""

    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(MlxdError):
    status = 401
    error_type = "authentication_error"


class ModelNotFound(MlxdError):
    status = 404
    error_type = "not_found_error"

    def __init__(self, model: str, available: list[str] | None = None) -> None:
        hint = f" Available models: {', '.join(sorted(available))}." if available else ""
        super().__init__(f"The model '{model}' does not exist.{hint}", param="model",
                         code="model_not_found")


class NotFound(MlxdError):
    status = 404
    error_type = "not_found_error"


class Conflict(MlxdError):
    status = 409
    error_type = "conflict_error"


class PayloadTooLarge(MlxdError):
    status = 413
    error_type = "invalid_request_error"


class Overloaded(MlxdError):
    """No capacity now (queue full, memory budget held); retry later (503)."""

    status = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code or "overloaded",
                         headers={"Retry-After": str(max(1, round(retry_after)))})
        self.retry_after = retry_after


class InsufficientStorage(MlxdError):
    """A model can never fit in the configured memory budget (507)."""

    status = 507
    error_type = "insufficient_storage"


class ModelLoadError(MlxdError):
    """A model failed to load (bad weights, missing files, unsupported format)."""

    status = 500
    error_type = "model_load_error"

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"Model '{model}' failed to load: {reason}", code="model_load_failed")
        self.model = model
        self.reason = reason


class GenerationFailed(MlxdError):
    """Generation of one request failed inside the engine; the batch goes on."""

    status = 500
    error_type = "server_error"
