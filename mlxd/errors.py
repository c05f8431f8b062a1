"""Errors every layer raises; the HTTP layer renders them in each API's shape.

Each error carries the HTTP status it maps to, so engines and the model
manager can refuse a request precisely without knowing about HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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


class ContextOverflow(InvalidRequest):
    """The prompt alone does not fit in the model's context (400).

    Carries the numbers so each API can word it as its clients expect (Anthropic's
    clients compact their history on ``prompt is too long: N tokens > M maximum``).
    ``prompt_tokens`` is the prompt's token count when ``counted`` (a prompt over 64K
    characters is counted in chunks, which may come out a few tokens short per chunk),
    else a lower bound (a prompt refused by its size alone); ``context`` is the model's
    context length.
    """

    def __init__(self, message: str, *, prompt_tokens: int, context: int, counted: bool,
                 param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.context = context
        self.counted = counted

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only fields survive a pickle
        return (_context_overflow, (self.message, self.prompt_tokens, self.context,
                                    self.counted, self.param))


def _context_overflow(message: str, prompt_tokens: int, context: int, counted: bool,
                      param: str | None) -> ContextOverflow:
    return ContextOverflow(message, prompt_tokens=prompt_tokens, context=context,
                           counted=counted, param=param)


class ModelNotFound(MlxdError):
    status = 404
    error_type = "not_found_error"

    def __init__(self, model: str, available: list[str] | None = None) -> None:
        if available:
            hint = f" Available models: {', '.join(sorted(available))}."
        elif available is None:
            hint = ""
        else:
            hint = (" This server serves no models at all: restart it with a model "
                    "(`mlxd serve MODEL`, or --models-config FILE with entries), or add one "
                    "with PUT /v1/models.")
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


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def validation_text(error: Mapping[str, Any]) -> str:
    """One pydantic error's message as a person should read it: a validator's own words
    without pydantic's "Value error, " prefix, and "field required" for a missing one."""
    if error.get("type") == "missing":
        return "field required"
    msg = str(error.get("msg", "invalid value"))
    for prefix in _PYDANTIC_PREFIXES:
        msg = msg.removeprefix(prefix)
    return msg
