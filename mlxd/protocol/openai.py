"""OpenAI Chat Completions and Completions request models.

Unknown fields are accepted and ignored (clients send many optional fields);
the mlxd extensions vLLM users expect (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``chat_template_kwargs``,
``regex``, ``grammar``...) are accepted at the top level, i.e. in the SDK's
``extra_body``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FunctionCall(_Lenient):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(_Lenient):
    """Sampling fields shared by chat and completions (OpenAI + mlxd extensions)."""

    model: str = Field(min_length=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=128)
    seed: StrictInt | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None  # in the schema too
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, StrictFloat] | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    regex: str | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | None = None
    # vLLM's cache_salt: prompts reuse each other's cached KV only under the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError("logit_bias values must be in [-100, 100]")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    reasoning_effort: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: StrictInt | None = None
    response_format: ResponseFormat | None = None
