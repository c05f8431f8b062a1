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
from mlxd.generation.params import Constraint, InputGrammar, ToolChoice, ToolSpec
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
    if constraint.kind == "llguidance":  # a ready TopLevelGrammar (JSON), built here
        return str(constraint.value)
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
    functions = [t for t in chosen if not t.freeform]
    freeform = [t for t in chosen if t.freeform]
    start = literal(fmt.start) if fmt.start else ""
    end = literal(fmt.end) if fmt.end else ""
    rules: list[str] = []
    alternatives: list[str] = []
    if functions:
        for t in functions:
            _check_json_schema(t.parameters)
        schema: dict[str, Any] = (_call_schema(functions[0]) if len(functions) == 1
                                  else {"anyOf": [_call_schema(t) for t in functions]})
        # Compact JSON: flexible whitespace lets a weak model pad forever.
        schema["x-guidance"] = {"whitespace_flexible": False}
        rules.append(f"json_call: %json {json.dumps(schema)}")
        alternatives.append(f"json_call {end}")
    subgrammars = _freeform_calls(freeform, fmt, end, rules, alternatives)
    lark = "\n".join([f"start: {start} call", "call: " + " | ".join(alternatives), *rules]) + "\n"
    if not freeform:
        return Constraint("lark", lark)
    top = {"grammars": [{"lark_grammar": lark}, *subgrammars]}
    return Constraint("llguidance", json.dumps(top))


def _freeform_calls(tools: list[ToolSpec], fmt: ToolCallFormat, end: str, rules: list[str],
                    alternatives: list[str]) -> list[dict[str, Any]]:
    """Add a forced call of each freeform tool to ``rules`` / ``alternatives``: written raw,
    the tool's name, a newline, then the input under the tool's grammar (a sub-grammar,
    returned) or as plain text."""
    subgrammars: list[dict[str, Any]] = []
    textual_end = bool(fmt.end) and end == _lark_literal(fmt.end)
    for i, t in enumerate(tools):
        head = json.dumps(t.name + "\n")
        if t.grammar is not None:
            subgrammars.append({"name": f"input_{i}", "lark_grammar": _input_lark(t.grammar)})
            alternatives.append(f"{head} @input_{i} {end}")
        elif textual_end:
            # plain text ends at the textual end marker, which closes it as a suffix
            rules.append(f"text_{i}[suffix={end}]: /(?s:.*)/")
            alternatives.append(f"{head} text_{i}")
        else:
            # an end marker that is one token (or none) never appears in text
            alternatives.append(f"{head} /(?s:.*)/ {end}")
    return subgrammars


def _input_lark(grammar: InputGrammar) -> str:
    """A freeform tool's grammar as Lark (a regex becomes a one-rule grammar)."""
    if grammar.syntax == "lark":
        return grammar.definition
    from llguidance import LLMatcher

    top = json.loads(LLMatcher.grammar_from_regex(grammar.definition))
    return str(top["grammars"][0]["lark_grammar"])


def check_input_grammar(grammar: InputGrammar, param: str) -> None:
    """A 400 naming the problem when a freeform tool's grammar does not compile."""
    from llguidance import LLMatcher

    try:
        lark = _input_lark(grammar)
    except ValueError as e:
        raise InvalidRequest(f"Invalid {grammar.syntax} grammar: {e}", param=param) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(lark, None)
    if is_error:
        first = messages[0].strip() if messages else "error"
        raise InvalidRequest(f"Invalid {grammar.syntax} grammar: {first}", param=param)


def forced_tool_format(fmt: ToolCallFormat | None) -> ToolCallFormat:
    """The format to force calls in: the model's own if its body is JSON, else Hermes."""
    if fmt is not None and fmt.json_body and fmt.start and fmt.end:
        return fmt
    return BUILTIN_TOOL_PARSERS["hermes"]
