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

import json
from dataclasses import dataclass, field
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import (
    FREEFORM_PARAMETERS,
    Constraint,
    GenerationRequest,
    InputGrammar,
    ToolChoice,
    ToolSpec,
)
from mlxd.generation.structured import check_input_grammar
from mlxd.protocol.responses import (
    ContentPart,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FilePart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    GrammarInputFormat,
    HostedTool,
    ImagePart,
    MessageItem,
    NamespaceTool,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
)
from mlxd.server.request_policy import sampling_choices, stop_list
from mlxd.server.tool_checks import (
    check_json_schema,
    check_tool_results,
    resolve_tool_choice,
    tool_spec_list,
)


@dataclass(frozen=True)
class ToolName:
    """Who a tool is to the client: its name, its namespace, whether it is freeform."""

    name: str
    namespace: str | None = None
    freeform: bool = False


@dataclass
class ToolTable:
    """The request's tools as the model sees them (flat, function-shaped) and the way
    back from the name the model calls to the name and shape the client expects.

    A namespace's functions are shown under their own names; a name that two
    tools share (two namespaces, or a namespace and a top-level tool) is shown as
    ``namespace.name``. Hosted tools are listed in ``hosted`` and never shown.
    """

    specs: list[ToolSpec] = field(default_factory=list)
    client: dict[str, ToolName] = field(default_factory=dict)  # model's name -> client's
    hosted: list[str] = field(default_factory=list)

    def model_name(self, name: str, namespace: str | None) -> str:
        """The name the model knows a client's (namespaced) tool by; unknown: as given."""
        for shown, tool in self.client.items():
            if tool.name == name and tool.namespace == namespace:
                return shown
        return f"{namespace}.{name}" if namespace else name


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


def input_messages(items: str | list[Any] | None,
                   table: ToolTable | None = None) -> list[dict[str, Any]]:
    """The request's own input as canonical messages (no instructions, no history).

    Calls are named as the model knows them (``table``: namespaced and custom
    tools); a custom call's text input becomes the arguments ``{"input": ...}``."""
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
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            turn = _open_turn(out, fresh_if=())
            name = table.model_name(item.name, item.namespace) if table else item.name
            arguments = (json.dumps({"input": item.input}, ensure_ascii=False)
                         if isinstance(item, CustomToolCallItem) else item.arguments or "{}")
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
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


def _flat_tools(req: ResponsesRequest) -> tuple[list[tuple[str, FunctionTool | CustomTool,
                                                          str | None]], list[str]]:
    """``(where, tool, namespace)`` for every function and custom tool, and the hosted types.

    A namespace's description opens each of its tools' descriptions: a flat tool
    has no other place to tell the model which group it belongs to."""
    flat: list[tuple[str, FunctionTool | CustomTool, str | None]] = []
    hosted: list[str] = []
    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                if tool.description:
                    text = "\n\n".join(t for t in (tool.description, inner.description) if t)
                    inner = inner.model_copy(update={"description": text})
                flat.append((f"tools[{i}].tools[{j}]", inner, tool.name))
        elif isinstance(tool, HostedTool):
            hosted.append(tool.type)
        else:
            flat.append((f"tools[{i}]", tool, None))
    return flat, hosted


def tool_table(req: ResponsesRequest) -> ToolTable:
    """The request's tools, flattened and checked (duplicates, schemas, grammars are 400s)."""
    flat, hosted = _flat_tools(req)
    counts: dict[str, int] = {}
    for _, tool, _ in flat:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    table = ToolTable(hosted=hosted)
    described: list[tuple[str, str | None, dict[str, Any] | None]] = []
    for where, tool, namespace in flat:
        shown = tool.name if counts[tool.name] == 1 or namespace is None \
            else f"{namespace}.{tool.name}"
        if shown in table.client:
            raise InvalidRequest(f"Duplicate tool name '{shown}'.", param=where)
        table.client[shown] = ToolName(tool.name, namespace, isinstance(tool, CustomTool))
        if isinstance(tool, FunctionTool):
            described.append((shown, tool.description, tool.parameters))
        else:
            described.append((shown, _freeform_description(tool), FREEFORM_PARAMETERS))
    specs = tool_spec_list(iter(described), param="tools", schema_field="parameters")
    for i, (where, tool, _) in enumerate(flat):
        if isinstance(tool, CustomTool):
            specs[i] = ToolSpec(specs[i].name, specs[i].description, specs[i].parameters,
                                freeform=True, grammar=_input_grammar(tool, where))
    table.specs = specs
    return table


def _input_grammar(tool: CustomTool, where: str) -> InputGrammar | None:
    fmt = tool.format
    if not isinstance(fmt, GrammarInputFormat):
        return None
    grammar = InputGrammar(fmt.syntax, fmt.definition)
    check_input_grammar(grammar, param=f"{where}.format.definition")
    return grammar


def _freeform_description(tool: CustomTool) -> str:
    """What the model reads about a freeform tool: its description and input format."""
    fmt = tool.format
    if not isinstance(fmt, GrammarInputFormat):
        rule = "Put the tool's whole input, as plain text, in `input`."
    else:
        rule = (f"Put the tool's whole input in `input`; it must follow this "
                f"{fmt.syntax} grammar:\n{fmt.definition}")
    return f"{tool.description}\n\n{rule}" if tool.description else rule


def tool_choice(req: ResponsesRequest, table: ToolTable) -> ToolChoice:
    """``tool_choice`` over the flattened tools; forcing a hosted tool is a 400."""
    choice, tools = req.tool_choice, table.specs
    if choice is None or isinstance(choice, str):
        if choice == "required" and not tools and table.hosted:
            raise InvalidRequest(
                f"tool_choice 'required' needs a tool this server can run; hosted tools "
                f"({', '.join(table.hosted)}) are not available here.", param="tool_choice")
        return resolve_tool_choice(choice, None, tools)
    if choice.type not in ("function", "custom"):
        what = "the hosted tool" if choice.type != "allowed_tools" else "a tool choice of type"
        raise InvalidRequest(
            f"tool_choice forces {what} '{choice.type}', which this server cannot run; use "
            "'auto', 'none', 'required' or a function or custom tool by name.",
            param="tool_choice")
    name = getattr(choice, "name", "")
    shown = table.model_name(name, getattr(choice, "namespace", None))
    if shown not in table.client:  # a namespaced tool named by its own name alone
        shown = next((k for k, v in table.client.items() if v.name == name), shown)
    wanted = choice.type == "custom"
    if shown in table.client and table.client[shown].freeform != wanted:
        kind = "a custom" if table.client[shown].freeform else "a function"
        raise InvalidRequest(f"tool_choice names '{name}' as a {choice.type} tool, but it is "
                             f"{kind} tool.", param="tool_choice")
    return resolve_tool_choice("function", shown, tools)


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


def template_kwargs(req: ResponsesRequest) -> dict[str, Any]:
    """``reasoning.effort`` ("none" turns thinking off), then ``chat_template_kwargs`` (the
    registry entry's go under both when the request is leased)."""
    kwargs: dict[str, Any] = {}
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        kwargs["enable_thinking"] = effort != "none"
    kwargs.update(req.chat_template_kwargs or {})
    return kwargs


def conversation(req: ResponsesRequest, history: list[dict[str, Any]],
                 table: ToolTable | None = None) -> list[dict[str, Any]]:
    """History (from ``previous_response_id``) plus this request's input, checked."""
    messages = [dict(m) for m in history] + input_messages(req.input, table)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input must contain at least one message.", param="input")
    _name_tool_results(messages)
    check_tool_results(messages, param="input", what="function_call_output for call_id")
    return messages


def generation_request(req: ResponsesRequest, messages: list[dict[str, Any]],
                       table: ToolTable) -> GenerationRequest:
    """``messages``: the checked conversation; ``instructions`` go in front of it. The
    client's values only: ``TextSession.open`` fills in the model's defaults."""
    tools = table.specs
    prompt = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    return GenerationRequest(
        messages=prompt + messages,
        sampling_choices=sampling_choices(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, repetition_penalty=req.repetition_penalty),
        max_tokens=req.max_output_tokens,
        stop=stop_list(req.stop), tools=tools, tool_choice=tool_choice(req, table),
        constraint=constraint(req), chat_template_kwargs=template_kwargs(req),
        cache_key=req.prompt_cache_key)
