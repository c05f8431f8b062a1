"""Anthropic Messages request -> ``GenerationRequest`` (canonical OpenAI-like messages).

* ``system`` (string or text blocks) becomes the first system message.
* A ``{"role": "system"}`` message inside ``messages`` (Anthropic's mid-conversation
  system message) stays a system message in place; the input processor renders it
  as a system turn where the chat template can, else folds it into the leading
  system prompt (``generation/chat.py``: ``fold_late_system``).
* Assistant turns: ``thinking`` -> ``reasoning_content``, ``text`` -> ``content``,
  ``tool_use`` -> ``tool_calls`` (arguments as JSON).
* User turns: each ``tool_result`` becomes a ``tool`` message (``tool_call_id``),
  text and image blocks become a user message. Image blocks become
  ``image_url`` parts, which a text model refuses with a 400 and a vision
  model can read.
* A final assistant turn is a prefill: generation continues it.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import Constraint, GenerationRequest, ToolChoice, ToolSpec
from mlxd.protocol.anthropic import (
    ImageBlock,
    Message,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    VideoBlock,
)
from mlxd.protocol.anthropic import ToolChoice as AnthropicToolChoice
from mlxd.server.anthropic_cache import cache_marks
from mlxd.server.request_policy import sampling_choices
from mlxd.server.tool_checks import (
    check_json_schema,
    check_tool_results,
    resolve_tool_choice,
    tool_spec_list,
)

_CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def image_part(block: ImageBlock | VideoBlock) -> dict[str, Any]:
    """An Anthropic image block as an OpenAI-style ``image_url`` part (a video block, an
    mlxd extension, as a ``video_url`` part)."""
    src = block.source
    kind = "image" if isinstance(block, ImageBlock) else "video"
    if src.type == "base64":
        default = "image/png" if kind == "image" else "video/mp4"
        url = f"data:{src.media_type or default};base64,{src.data or ''}"
    elif src.type == "url":
        url = src.url or ""
    else:
        url = f"file:{src.file_id or ''}"
    return {"type": f"{kind}_url", f"{kind}_url": {"url": url}}


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Plain text when every part is text (joined by newlines), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_result_message(block: ToolResultBlock, names: dict[str, str]) -> dict[str, Any]:
    content = block.content
    if isinstance(content, list):
        parts = [{"type": "text", "text": p.text} if isinstance(p, TextBlock) else image_part(p)
                 for p in content]
        text: str | list[dict[str, Any]] = _parts_content(parts)
    else:
        text = content or ""
    message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id,
                               "content": text}
    if block.tool_use_id in names:
        message["name"] = names[block.tool_use_id]
    return message


def _user_messages(message: Message, names: dict[str, str], where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": _parts_content(parts)})
                parts = []
            out.append(_tool_result_message(block, names))
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock | VideoBlock):
            parts.append(image_part(block))
        else:
            raise InvalidRequest(f"A user message cannot contain a '{block.type}' block.",
                                 param=f"{where}.content[{j}]")
    if parts:
        out.append({"role": "user", "content": _parts_content(parts)})
    return out


def _assistant_message(message: Message, names: dict[str, str], where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif block.type != "redacted_thinking":
            raise InvalidRequest(f"An assistant message cannot contain a '{block.type}' block.",
                                 param=f"{where}.content[{j}]")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _system_message_text(message: Message, where: str) -> str:
    """A system message in ``messages``: its text (text blocks only)."""
    if isinstance(message.content, str):
        return message.content
    for j, block in enumerate(message.content):
        if not isinstance(block, TextBlock):
            raise InvalidRequest(f"A system message can contain only 'text' blocks, not "
                                 f"'{block.type}'.", param=f"{where}.content[{j}]")
    return "\n".join(b.text for b in message.content if isinstance(b, TextBlock))


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b.text for b in system) or None


def canonical_messages(req: MessagesInput) -> list[dict[str, Any]]:
    """The conversation as canonical messages; tool results must answer earlier tool_use ids."""
    out: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, list) and not message.content and \
                not (i == last and message.role == "assistant"):
            # Anthropic's rule and words: only a final assistant turn may be empty.
            raise InvalidRequest(f"{where}: all messages must have non-empty content except "
                                 "for the optional final assistant message",
                                 param=f"{where}.content")
        if message.role == "user":
            out.extend(_user_messages(message, names, where))
        elif message.role == "system":
            out.append({"role": "system", "content": _system_message_text(message, where)})
        else:
            out.append(_assistant_message(message, names, where))
    check_tool_results(out, param="messages", what="tool_result for tool_use id")
    return out


def tool_specs(req: MessagesInput) -> list[ToolSpec]:
    return tool_spec_list(((t.name, t.description, t.input_schema) for t in req.tools or []),
                          param="tools", schema_field="input_schema")


def tool_choice(choice: AnthropicToolChoice | None, tools: list[ToolSpec]) -> ToolChoice:
    """auto -> auto, any -> required, tool -> the named function, none -> none."""
    if choice is None:
        return resolve_tool_choice(None, None, tools)
    return resolve_tool_choice(_CHOICE_MODES[choice.type], choice.name, tools,
                               shown=choice.type)


def constraint(req: MessagesRequest) -> Constraint | None:
    """``output_config.format`` (a JSON schema) as a structured-output constraint."""
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    return Constraint("json_schema",
                      check_json_schema(fmt.schema_, param="output_config.format.schema"))


def template_kwargs(req: MessagesInput) -> dict[str, Any]:
    """``thinking`` as ``enable_thinking``, then explicit kwargs (the registry entry's go
    under both when the request is leased)."""
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    kwargs.update(req.chat_template_kwargs or {})
    return kwargs


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """A last assistant turn with text and no tool calls is continued, not answered."""
    if not messages:
        return False
    last = messages[-1]
    return last["role"] == "assistant" and bool(last.get("content")) and not last.get("tool_calls")


def generation_request(req: MessagesInput) -> GenerationRequest:
    """The request as a ``GenerationRequest`` of the client's values (``TextSession.open``
    fills in the model's defaults); ``max_tokens`` is capped to the context when the prompt
    is prepared (``generation/output_length.py``)."""
    tools = tool_specs(req)
    choice = tool_choice(req.tool_choice, tools)
    messages = canonical_messages(req)
    prefill = is_prefill(messages)
    gen = GenerationRequest(messages=messages, tools=tools, tool_choice=choice,
                            chat_template_kwargs=template_kwargs(req),
                            add_generation_prompt=not prefill, continue_final_message=prefill,
                            cache_marks=cache_marks(req, canonical_messages))
    if isinstance(req, MessagesRequest):
        gen.sampling_choices = sampling_choices(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
        gen.stop = [s for s in req.stop_sequences or [] if s]
        gen.constraint = constraint(req)
        gen.max_tokens = req.max_tokens or None  # 0: nothing is generated (see the route)
    return gen
