"""Tool-call formats: the markup a model family uses, and how to parse it.

Formats are chosen with ``--tool-call-parser NAME`` or detected from the chat
template. JSON formats are ours (small); the other formats mlx-lm already
parses are wrapped, not rewritten (``mlx_lm.tool_parsers``, imported lazily
because importing mlx-lm loads MLX).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mlxd.generation.params import ToolSpec

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


def _calls_from_json_value(value: Any) -> list[ParsedCall]:
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


def parse_json_calls(text: str, tools: list[ToolSpec] | None = None) -> list[ParsedCall]:
    """One or more JSON tool calls: an object, a list, or objects separated by ``;``/newlines."""
    text = text.strip()
    if not text:
        raise ToolParseError("empty tool call")
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"tool call is not valid JSON: {text[:200]!r}") from e
        calls.extend(_calls_from_json_value(value))
    return calls


def _mlx_lm_parser(module_name: str) -> ParseFn:
    def parse(text: str, tools: list[ToolSpec] | None = None) -> list[ParsedCall]:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
        openai_tools = [t.as_openai() for t in tools or []]
        try:
            parsed = module.parse_tool_call(text, openai_tools)
        except (ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            raise ToolParseError(f"{module_name}: {e}") from e
        return _calls_from_json_value(parsed)

    return parse


# (mlx-lm module, start, end, families). Start/end mirror the module's own
# constants; a test checks they still agree with the installed mlx-lm.
_MLX_LM_FORMATS = (
    ("json_tools", "<tool_call>", "</tool_call>", "Qwen2.5/Qwen3, Hermes (JSON in <tool_call>)"),
    ("qwen3_coder", "<tool_call>", "</tool_call>", "Qwen3-Coder (XML <function=...>)"),
    ("mistral", "[TOOL_CALLS]", "", "Mistral, Devstral, Magistral"),
    ("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", "LFM2, pythonic calls"),
    ("glm47", "<tool_call>", "</tool_call>", "GLM-4.5/4.7"),
    ("laguna", "<tool_call>", "</tool_call>", "Laguna"),
    ("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", "MiniMax-M2"),
    ("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "Kimi K2"),
    ("kimi_k3", "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", "Kimi K3"),
    ("function_gemma", "<start_function_call>", "<end_function_call>", "FunctionGemma"),
    ("gemma4", "<|tool_call>", "<tool_call|>", "Gemma 4"),
    ("longcat", "<longcat_tool_call>", "</longcat_tool_call>", "LongCat"),
    ("minicpm5", "<function name=", "</function>", "MiniCPM 5"),
    ("muse_spark", "<atem:function_calls>", "</atem:function_calls>", "Muse Spark"),
)

_FORMATS: tuple[ToolCallFormat, ...] = (
    ToolCallFormat("hermes", "<tool_call>", "</tool_call>", parse_json_calls,
                   "Hermes, Qwen2.5, Qwen3, SmolLM3 and models without a tool template",
                   json_body=True),
    ToolCallFormat("llama3_json", "<|python_tag|>", "", parse_json_calls,
                   "Llama 3.1/3.2/3.3 (JSON call, optionally after <|python_tag|>)",
                   json_body=True, bare_json_start=True),
    *(ToolCallFormat(m, s, e, _mlx_lm_parser(m), fam, json_body=(m == "json_tools"))
      for m, s, e, fam in _MLX_LM_FORMATS),
)

TOOL_CALL_FORMATS = MappingProxyType({f.name: f for f in _FORMATS})


def detect_tool_format(chat_template: str | None, mlx_lm_parser: str | None = None) -> ToolCallFormat:
    """Pick the format for a model: mlx-lm's own detection first, then template
    markers; models whose template knows no tools get ``hermes`` (mlxd then
    describes the tools in a system message)."""
    if mlx_lm_parser == "json_tools":
        return TOOL_CALL_FORMATS["hermes"]
    if mlx_lm_parser and mlx_lm_parser in TOOL_CALL_FORMATS:
        return TOOL_CALL_FORMATS[mlx_lm_parser]
    template = chat_template or ""
    if "<|python_tag|>" in template or re.search(r"\"parameters\"\s*:\s*", template):
        return TOOL_CALL_FORMATS["llama3_json"]
    if "[TOOL_CALLS]" in template:
        return TOOL_CALL_FORMATS["mistral"]
    return TOOL_CALL_FORMATS["hermes"]


def tool_call_format(name: str | None, chat_template: str | None,
                     mlx_lm_parser: str | None = None) -> ToolCallFormat:
    """Resolve ``--tool-call-parser NAME`` (or auto-detect when None/"auto")."""
    if name and name != "auto":
        try:
            return TOOL_CALL_FORMATS[name]
        except KeyError:
            raise ValueError(
                f"Unknown tool-call parser '{name}'. Known: {', '.join(TOOL_CALL_FORMATS)}"
            ) from None
    return detect_tool_format(chat_template, mlx_lm_parser)
