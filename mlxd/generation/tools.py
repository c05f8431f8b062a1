"""Tool-call formats: the markup a model family uses, and how to parse it.

A format is registered by name and chosen with ``--tool-call-parser NAME`` or
detected from the tokenizer. The JSON formats registered here are ours and
backend-free (``BUILTIN_TOOL_PARSERS``); the formats mlx-lm already parses are
wrapped, not rewritten, in ``mlxd/engines/text/tool_parsers.py``, whose registry
extends this one (this layer never imports mlx-lm).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mlxd.generation.params import ToolSpec
from mlxd.generation.registry import NamedRegistry

ParsedCall = dict[str, Any]  # {"name": str, "arguments": dict | str, optional "id"}
ParseFn = Callable[[str, list[ToolSpec]], list[ParsedCall]]


class ToolParseError(ValueError):
    """The model's tool-call markup could not be parsed."""


@dataclass(frozen=True)
class ToolCallFormat:
    """``start``/``end`` delimit one call ("" end: the call runs to the end of output).

    ``json_body`` formats can be forced by constrained decoding (their body is
    a JSON object ``{"name": ..., "arguments": {...}}``).
    """

    name: str
    start: str
    end: str
    parse: ParseFn
    families: str
    json_body: bool = False
    bare_json_start: bool = False


def calls_from_json_value(value: Any) -> list[ParsedCall]:
    """Calls from decoded JSON: one object or a list, ``{"function": {...}}`` unwrapped."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            raise ToolParseError(f"tool call is not a JSON object: {item!r}")
        if "function" in item and isinstance(item["function"], dict):
            item = item["function"]
        name = item.get("name")
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(name, str) or not name:
            raise ToolParseError(f"tool call without a name: {item!r}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ToolParseError(f"tool call arguments are not JSON: {args!r}") from e
        call: ParsedCall = {"name": name, "arguments": args}
        if isinstance(item.get("id"), str):
            call["id"] = item["id"]
        calls.append(call)
    return calls


BUILTIN_TOOL_PARSERS: NamedRegistry[ToolCallFormat] = NamedRegistry("tool-call parser")


def tool_parser(registry: NamedRegistry[ToolCallFormat], name: str, start: str, end: str,
                families: str, *, json_body: bool = False,
                bare_json_start: bool = False) -> Callable[[ParseFn], ParseFn]:
    """Decorator: register the decorated parse function as format ``name`` in ``registry``."""

    def register(parse: ParseFn) -> ParseFn:
        registry.add(ToolCallFormat(name, start, end, parse, families, json_body=json_body,
                                    bare_json_start=bare_json_start))
        return parse

    return register


@tool_parser(BUILTIN_TOOL_PARSERS, "llama3_json", "<|python_tag|>", "",
             "Llama 3.1/3.2/3.3 (JSON call, optionally after <|python_tag|>)",
             json_body=True, bare_json_start=True)
@tool_parser(BUILTIN_TOOL_PARSERS, "hermes", "<tool_call>", "</tool_call>",
             "Hermes, Qwen2.5, Qwen3, SmolLM3 and models without a tool template",
             json_body=True)
def parse_json_calls(text: str, tools: list[ToolSpec] | None = None) -> list[ParsedCall]:
    """One or more JSON tool calls: an object, a list, or objects separated by ``;``/newlines."""
    text = text.strip()
    if not text:
        raise ToolParseError("empty tool call")
    calls: list[ParsedCall] = []
    try:
        for value, _end in json_values(text):
            calls.extend(calls_from_json_value(value))
    except json.JSONDecodeError as e:
        raise ToolParseError(f"tool call is not valid JSON: {text[:200]!r}") from e
    return calls


JSON_SEPARATORS = " \t\r\n;,"


def json_values(text: str) -> Iterator[tuple[Any, int]]:
    """The JSON values in ``text``, separated by whitespace, ``;`` or ``,``: each with
    the offset where it ends. Raises ``json.JSONDecodeError`` at the first invalid one."""
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        while pos < len(text) and text[pos] in JSON_SEPARATORS:
            pos += 1
        if pos >= len(text):
            return
        value, pos = decoder.raw_decode(text, pos)
        yield value, pos
