"""Anthropic Messages API request models (``/v1/messages``, ``/v1/messages/count_tokens``).

Unknown fields are accepted and ignored (Claude Code sends ``cache_control``,
``context_management`` and other fields a local server has no use for);
``metadata`` and ``output_config.effort`` are accepted and ignored too.
Content blocks are a discriminated union on ``type``: a block type mlxd does
not know is a 400 naming the type. ``chat_template_kwargs`` is an mlxd
extension (the SDK's ``extra_body``).
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
    model_validator,
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ImageSource(_Lenient):
    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class ImageBlock(_Lenient):
    type: Literal["image"]
    source: ImageSource


class VideoBlock(_Lenient):
    """mlxd extension (Anthropic's API has no video): a video for a vision model, with an
    image block's sources (``base64`` with a video media type, or ``url``)."""

    type: Literal["video"]
    source: ImageSource


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


ToolResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultPart] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | VideoBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Lenient):
    """A turn. ``system`` is Anthropic's mid-conversation system message (text only),
    which Claude Code sends for models it does not know."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    """A client tool. Server tools (``web_search_*``, ``bash_*``...) are refused."""

    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(
                f"tool type '{data['type']}' is an Anthropic server tool; mlxd runs only "
                "client tools (a name, a description and an input_schema)")
        return data


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a 'name'")
        return self


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = Field(None, ge=0)


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    """Structured output (``format``); ``effort`` is accepted and ignored."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesInput(_Lenient):
    """What both ``/v1/messages`` and ``/v1/messages/count_tokens`` take."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(MessagesInput):
    max_tokens: StrictInt = Field(ge=0)  # 0: check and count the prompt, generate nothing
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stream: StrictBool = False


class CountTokensRequest(MessagesInput):
    pass
