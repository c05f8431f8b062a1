"""Structured output: turn a request's constraint into an llguidance grammar.

JSON schema (``response_format`` / Anthropic / Responses ``text.format``),
``json_object``, mlxd's ``regex`` and ``grammar`` (Lark) extensions, and the
grammar that forces a tool call for ``tool_choice: required`` or a named
function. Invalid schemas and grammars are 400s that name the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import Constraint, ToolChoice, ToolSpec
from mlxd.generation.schema_limits import check_schema_depth, check_schema_satisfiable
from mlxd.generation.tools import BUILTIN_TOOL_PARSERS, ToolCallFormat

# Bound schema size and depth of generated grammars: a hostile schema must not
# make the grammar compiler run away.
MAX_SCHEMA_BYTES = 256 * 1024


def _check_json_schema(schema: Any) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise InvalidRequest("The JSON schema must be an object.", param="response_format")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"The JSON schema is larger than {MAX_SCHEMA_BYTES} bytes.",
                             param="response_format")
    # Depth first: the validator below recurses once per level.
    check_schema_depth(schema, param="response_format")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidRequest(f"Invalid JSON schema at {path}: {e.message}",
                             param="response_format") from None
    check_schema_satisfiable(schema, param="response_format")


def grammar_for(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint (not yet checked against a tokenizer)."""
    from llguidance import LLMatcher

    if constraint.kind == "json_schema":
        _check_json_schema(constraint.value)
        try:
            return LLMatcher.grammar_from_json_schema(
                constraint.value, defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise InvalidRequest(f"Invalid JSON schema: {e}", param="response_format") from None
    if constraint.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                  defaults={"whitespace_flexible": False})
    if constraint.kind == "regex":
        if not isinstance(constraint.value, str) or not constraint.value:
            raise InvalidRequest("regex must be a non-empty string.", param="regex")
        return LLMatcher.grammar_from_regex(constraint.value)
    if constraint.kind in ("grammar", "lark"):
        if not isinstance(constraint.value, str) or not constraint.value.strip():
            raise InvalidRequest("grammar must be a non-empty Lark grammar.", param="grammar")
        return LLMatcher.grammar_from_lark(constraint.value)
    raise InvalidRequest(f"Unknown constraint kind {constraint.kind!r}")


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    params = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def tool_call_constraint(tools: list[ToolSpec], choice: ToolChoice, fmt: ToolCallFormat,
                         literal: Callable[[str], str] | None = None) -> Constraint:
    """A Lark grammar that admits exactly one call in ``fmt``'s markup.

    ``required``: any of the tools; a named function: that one only.
    ``literal`` writes a marker in Lark: a quoted string by default; the engine
    passes one that writes ``<[id]>`` when the marker is a single added token
    (llguidance matches added tokens only by id, never as text).
    """
    literal = literal or _lark_literal
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
    else:
        chosen = list(tools)
    if not chosen:
        raise InvalidRequest("tool_choice needs at least one matching tool.", param="tool_choice")
    for t in chosen:
        _check_json_schema(t.parameters)
    schema: dict[str, Any] = (_call_schema(chosen[0]) if len(chosen) == 1
                              else {"anyOf": [_call_schema(t) for t in chosen]})
    # Compact JSON: flexible whitespace lets a weak model pad forever.
    schema["x-guidance"] = {"whitespace_flexible": False}
    body = "%json " + json.dumps(schema)
    start = literal(fmt.start) if fmt.start else None
    end = literal(fmt.end) if fmt.end else None
    parts = [p for p in (start, "call", end) if p]
    lark = f"start: {' '.join(parts)}\ncall: {body}\n"
    return Constraint("lark", lark)


def forced_tool_format(fmt: ToolCallFormat | None) -> ToolCallFormat:
    """The format to force calls in: the model's own if its body is JSON, else Hermes."""
    if fmt is not None and fmt.json_body and fmt.start and fmt.end:
        return fmt
    return BUILTIN_TOOL_PARSERS["hermes"]
