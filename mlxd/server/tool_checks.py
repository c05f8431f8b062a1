"""Checks shared by the Anthropic and Responses adapters: tool definitions,
tool_choice, JSON schemas and tool results, all refused with a 400 before any
model is loaded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import ToolChoice, ToolSpec
from mlxd.generation.schema_limits import check_schema_depth, check_schema_satisfiable

EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


def check_json_schema(schema: Any, *, param: str, want_object: bool = False) -> dict[str, Any]:
    """Return ``schema`` if it is a valid JSON Schema (per its own ``$schema`` draft).

    ``want_object``: the schema must describe an object (tool inputs). A bad
    schema is an ``InvalidRequest`` naming the problem and where it is.
    """
    from jsonschema import exceptions, validators

    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON Schema object.", param=param)
    check_schema_depth(schema, param=param)  # before the validator recurses through it
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at '{where}'" if where else ""
        raise InvalidRequest(f"{param} is not a valid JSON Schema{at}: {e.message}",
                             param=param) from None
    check_schema_satisfiable(schema, param=param)
    if want_object and schema.get("type", "object") != "object":
        raise InvalidRequest(f"{param} must describe an object (\"type\": \"object\"), "
                             f"not {schema.get('type')!r}.", param=param)
    return schema


def tool_spec_list(tools: Iterable[tuple[str, str | None, dict[str, Any] | None]], *,
                   param: str, schema_field: str) -> list[ToolSpec]:
    """``ToolSpec``s from ``(name, description, schema)``; duplicate names and bad schemas are 400s."""
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, (name, description, schema) in enumerate(tools):
        where = f"{param}[{i}]"
        if name in seen:
            raise InvalidRequest(f"Duplicate tool name '{name}'.", param=where)
        seen.add(name)
        params = (EMPTY_OBJECT_SCHEMA if schema is None else
                  check_json_schema(schema, param=f"{where}.{schema_field}", want_object=True))
        specs.append(ToolSpec(name, description, params))
    return specs


def resolve_tool_choice(mode: str | None, name: str | None, tools: list[ToolSpec], *,
                        param: str = "tool_choice", shown: str | None = None) -> ToolChoice:
    """``mode``: auto / none / required / function (then ``name`` must be one of ``tools``).

    ``shown`` is the client's own word for the mode in errors (Anthropic's ``any``).
    """
    if mode is None:
        return ToolChoice("auto" if tools else "none")
    if mode == "none":
        return ToolChoice("none")
    if not tools:
        raise InvalidRequest(f"{param} '{shown or mode}' requires tools to be specified.",
                             param=param)
    if mode == "function":
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools)
            raise InvalidRequest(f"{param} names tool '{name}', which is not in tools "
                                 f"(tools: {known}).", param=param)
        return ToolChoice("function", name)
    if mode not in ("auto", "required"):
        raise InvalidRequest(f"Unknown {param} '{mode}'.", param=param)
    return ToolChoice(mode)  # type: ignore[arg-type]


def check_tool_results(messages: list[dict[str, Any]], *, param: str, what: str) -> None:
    """Every ``tool`` message must answer a tool call made earlier in the conversation.

    ``what`` names the client's concept in the error ("tool_result for tool_use id",
    "function_call_output for call_id").
    """
    known: set[str] = set()
    for message in messages:
        for call in message.get("tool_calls") or []:
            if call.get("id"):
                known.add(call["id"])
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in known:
                raise InvalidRequest(f"{what} '{call_id}' does not match any earlier tool call.",
                                     param=param)
