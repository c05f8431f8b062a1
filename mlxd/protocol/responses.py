"""OpenAI Responses API request models (``POST /v1/responses``).

``input`` is a string or a list of items: messages (``type`` may be left
out), ``function_call``, ``function_call_output`` and ``reasoning``. Only
function tools are served. Unknown fields are accepted and ignored; the mlxd
sampling extensions of the chat API (``top_k``, ``min_p``, ``seed``,
``repetition_penalty``, ``stop``, ``chat_template_kwargs``, ``regex``,
``grammar``) are accepted at the top level (the SDK's ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class FilePart(_Lenient):
    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


ContentPart = Annotated[TextPart | RefusalPart | ImagePart | FilePart,
                        Field(discriminator="type")]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = ""
    id: str | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


class ReasoningText(_Lenient):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_type(value: Any) -> str:
    """Message items may leave ``type`` out (the SDK's ``EasyInputMessage``)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Lenient):
    """The Responses (flat) function tool: ``{type, name, description, parameters}``."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # mlxd extensions
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=2**64 - 1)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, allow_inf_nan=False)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
