"""OpenAI Responses API request models (``POST /v1/responses``).

``input`` is a string or a list of items: messages (``type`` may be left
out), ``function_call``, ``function_call_output``, ``custom_tool_call``,
``custom_tool_call_output`` and ``reasoning``. Tools: ``function``,
``custom`` (freeform text, optionally under a Lark or regex grammar) and
``namespace`` (a group of those); hosted tools the server cannot run
(``web_search``, ``file_search``, ...) are accepted and never shown to the
model. Unknown fields are accepted and ignored; the mlxd
sampling extensions of the chat API (``top_k``, ``min_p``, ``seed``,
``repetition_penalty``, ``stop``, ``chat_template_kwargs``, ``regex``,
``grammar``) are accepted at the top level (the SDK's ``extra_body``).
"""

from __future__ import annotations

import re
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
    field_validator,
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
    namespace: str | None = None  # the ``namespace`` tool the function belongs to
    id: str | None = None


class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str = ""
    namespace: str | None = None
    id: str | None = None


class CustomToolCallOutputItem(_Lenient):
    type: Literal["custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


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
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Lenient):
    """The Responses (flat) function tool: ``{type, name, description, parameters}``."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


# A custom tool's grammar may be long (Codex's apply_patch Lark grammar is ~1 KB);
# bounded so a hostile one cannot make the grammar compiler run away.
MAX_GRAMMAR_CHARS = 64 * 1024


class TextInputFormat(_Lenient):
    type: Literal["text"]


class GrammarInputFormat(_Lenient):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)


class CustomTool(_Lenient):
    """A freeform tool: the model's call is plain text (``input``), not JSON arguments."""

    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    format: Annotated[TextInputFormat | GrammarInputFormat,
                      Field(discriminator="type")] | None = None


class NamespaceTool(_Lenient):
    """A group of function and custom tools; calls name the namespace beside the tool."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(
        min_length=1, max_length=512)


# Tools OpenAI runs on its side (or that need its own item types): accepted, never
# offered to the model, since this server cannot run them. Dated variants
# (``web_search_2025_08_26``) are the same tools.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer",
    "computer_use", "computer_use_preview", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling"})
_DATED = re.compile(r"^(?P<base>[a-z_]+?)_\d{4}_\d{2}_\d{2}$")


def hosted_tool_type(kind: str) -> bool:
    """Whether ``kind`` is one of OpenAI's hosted tool types (or a dated variant)."""
    dated = _DATED.match(kind)
    return kind in HOSTED_TOOL_TYPES or (dated is not None
                                         and dated["base"] in HOSTED_TOOL_TYPES)


class HostedTool(_Lenient):
    """A hosted tool (``HOSTED_TOOL_TYPES``): accepted, never shown to the model."""

    type: str = Field(min_length=1, max_length=128)

    @field_validator("type")
    @classmethod
    def _known(cls, kind: str) -> str:
        if not hosted_tool_type(kind):
            raise ValueError(f"unknown tool type '{kind}'; tools are 'function', 'custom', "
                             "'namespace' or one of OpenAI's hosted tools "
                             f"({', '.join(sorted(HOSTED_TOOL_TYPES))})")
        return kind


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_type),
]


class NamedFunctionChoice(_Lenient):
    type: Literal["function", "custom"]
    name: str = Field(min_length=1)


class HostedToolChoice(_Lenient):
    """``{"type": "web_search"}``, ``{"type": "mcp", ...}``...: forcing a hosted tool."""

    type: str = Field(min_length=1, max_length=128)


def _choice_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "named" if kind in ("function", "custom") else "hosted"


ToolChoiceObject = Annotated[
    Annotated[NamedFunctionChoice, Tag("named")] | Annotated[HostedToolChoice, Tag("hosted")],
    Discriminator(_choice_type),
]


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
    tools: Annotated[list[Tool], Field(max_length=1024)] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceObject | None = None
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
    # Requests with the same key share their cached prompt prefix (mlxd keeps it
    # resident ahead of LRU eviction); see docs/anthropic-and-responses.md.
    prompt_cache_key: str | None = Field(None, max_length=256)
    # mlxd extensions
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=2**64 - 1)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, allow_inf_nan=False)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
