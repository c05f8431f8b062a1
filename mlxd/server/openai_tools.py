"""OpenAI-side translation of tools, tool_choice and structured-output options."""

from __future__ import annotations

from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import Constraint, ToolChoice, ToolSpec
from mlxd.protocol.openai import NamedToolChoice, ResponseFormat, ToolDef


def tool_specs(tools: list[ToolDef] | None) -> list[ToolSpec]:
    specs = []
    seen = set()
    for i, t in enumerate(tools or []):
        fn = t.function
        if fn.name in seen:
            raise InvalidRequest(f"Duplicate tool name '{fn.name}'.", param=f"tools[{i}]")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        specs.append(ToolSpec(fn.name, fn.description, params))
    return specs


def tool_choice(choice: str | NamedToolChoice | None, tools: list[ToolSpec]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if not tools and choice != "none":
        raise InvalidRequest("tool_choice requires tools to be specified.", param="tool_choice")
    if isinstance(choice, str):
        return ToolChoice(choice)  # type: ignore[arg-type]
    name = choice.function.name
    if name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names function '{name}', which is not in tools.",
                             param="tool_choice")
    return ToolChoice("function", name)


def constraint(response_format: ResponseFormat | None, *, regex: str | None = None,
               grammar: str | None = None, guided_json: dict[str, Any] | None = None
               ) -> Constraint | None:
    """The structured-output constraint a request asks for (at most one)."""
    found: list[Constraint] = []
    if response_format is not None and response_format.type == "json_schema":
        js = response_format.json_schema
        if js is None or js.schema_ is None:
            raise InvalidRequest("response_format json_schema needs a 'json_schema.schema'.",
                                 param="response_format")
        found.append(Constraint("json_schema", js.schema_))
    elif response_format is not None and response_format.type == "json_object":
        found.append(Constraint("json_object"))
    if guided_json is not None:
        found.append(Constraint("json_schema", guided_json))
    if regex is not None:
        found.append(Constraint("regex", regex))
    if grammar is not None:
        found.append(Constraint("grammar", grammar))
    if len(found) > 1:
        raise InvalidRequest("Use only one of response_format, regex, grammar, guided_json.",
                             param="response_format")
    return found[0] if found else None
