"""Responses API request -> ``GenerationRequest`` (canonical OpenAI-like messages).

Input items become canonical messages: message items keep their role
(``developer`` -> ``system``); ``reasoning``, assistant text and
``function_call`` items that follow each other form one assistant turn
(``reasoning_content``, ``content``, ``tool_calls``); ``function_call_output``
becomes a ``tool`` message. ``instructions`` is a system message in front of
the conversation and, as in OpenAI's API, is not carried over by
``previous_response_id``.
"""

from __future__ import annotations

from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import Constraint, GenerationRequest, ToolChoice, ToolSpec
from mlxd.models.spec import ServingDefaults
from mlxd.protocol.responses import (
    ContentPart,
    FilePart,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    MessageItem,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
)
from mlxd.server.text_session import pick, sampling_params, stop_list
from mlxd.server.tool_checks import (
    check_json_schema,
    check_tool_results,
    resolve_tool_choice,
    tool_spec_list,
)


def _part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, RefusalPart):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, ImagePart):
        url = part.image_url or f"file:{part.file_id or ''}"
        return {"type": "image_url", "image_url": {"url": url}}
    if isinstance(part, FilePart):
        return {"type": "file", "file": {"file_id": part.file_id, "filename": part.filename}}
    return {"type": "text", "text": part.text}


def content_of(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """Plain text when every part is text, else OpenAI-style parts (images for vision models)."""
    if isinstance(content, str):
        return content
    parts = [_part(p) for p in content]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _open_turn(out: list[dict[str, Any]], *, fresh_if: tuple[str, ...]) -> dict[str, Any]:
    """The assistant turn being built, or a new one if the last turn has any of ``fresh_if``."""
    last = out[-1] if out else None
    if last is None or last["role"] != "assistant" or any(last.get(k) for k in fresh_if):
        last = {"role": "assistant", "content": ""}
        out.append(last)
    return last


def input_messages(items: str | list[Any] | None) -> list[dict[str, Any]]:
    """The request's own input as canonical messages (no instructions, no history)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = _open_turn(out, fresh_if=("content", "tool_calls"))
            turn["content"] = content_of(item.content)
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": content_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            turn = _open_turn(out, fresh_if=())
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments or "{}"}})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": content_of(item.output)})
        elif isinstance(item, ReasoningItem):
            turn = _open_turn(out, fresh_if=("content", "tool_calls", "reasoning_content"))
            texts = item.content if item.content else item.summary
            turn["reasoning_content"] = "".join(t.text for t in texts)
    return out


def _name_tool_results(messages: list[dict[str, Any]]) -> None:
    """Give each tool message the name of the call it answers (some templates show it)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id", ""))
            if name:
                message["name"] = name


def tool_specs(req: ResponsesRequest) -> list[ToolSpec]:
    return tool_spec_list(((t.name, t.description, t.parameters) for t in req.tools or []),
                          param="tools", schema_field="parameters")


def tool_choice(req: ResponsesRequest, tools: list[ToolSpec]) -> ToolChoice:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return resolve_tool_choice(choice, None, tools)
    return resolve_tool_choice("function", choice.name, tools)


def constraint(req: ResponsesRequest) -> Constraint | None:
    """``text.format`` (json_schema / json_object), or the ``regex`` / ``grammar`` extensions."""
    found: list[Constraint] = []
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format of type json_schema needs a 'schema'.",
                                 param="text.format.schema")
        found.append(Constraint("json_schema",
                                check_json_schema(fmt.schema_, param="text.format.schema")))
    elif fmt is not None and fmt.type == "json_object":
        found.append(Constraint("json_object"))
    if req.regex is not None:
        found.append(Constraint("regex", req.regex))
    if req.grammar is not None:
        found.append(Constraint("grammar", req.grammar))
    if len(found) > 1:
        raise InvalidRequest("Use only one of text.format (json), regex and grammar.",
                             param="text.format")
    return found[0] if found else None


def template_kwargs(req: ResponsesRequest, defaults: ServingDefaults) -> dict[str, Any]:
    """Registry defaults, then ``reasoning.effort`` ("none" turns thinking off), then kwargs."""
    kwargs = dict(defaults.chat_template_kwargs)
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        kwargs["enable_thinking"] = effort != "none"
    kwargs.update(req.chat_template_kwargs or {})
    return kwargs


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History (from ``previous_response_id``) plus this request's input, checked."""
    messages = [dict(m) for m in history] + input_messages(req.input)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input must contain at least one message.", param="input")
    _name_tool_results(messages)
    check_tool_results(messages, param="input", what="function_call_output for call_id")
    return messages


def generation_request(req: ResponsesRequest, defaults: ServingDefaults,
                       messages: list[dict[str, Any]]) -> GenerationRequest:
    """``messages``: the checked conversation; ``instructions`` go in front of it."""
    tools = tool_specs(req)
    prompt = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    return GenerationRequest(
        messages=prompt + messages,
        sampling=sampling_params(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, repetition_penalty=req.repetition_penalty, presence_penalty=None,
            frequency_penalty=None, logit_bias=None, defaults=defaults),
        max_tokens=pick(req.max_output_tokens, defaults.max_tokens),
        stop=stop_list(req.stop), tools=tools, tool_choice=tool_choice(req, tools),
        constraint=constraint(req), chat_template_kwargs=template_kwargs(req, defaults))
