"""Tool-call formats mlx-lm parses, and the choice of one for a loaded tokenizer.

``TOOL_PARSERS`` is every name ``--tool-call-parser`` accepts: the backend-free
JSON formats (``mlxd.generation.tools.BUILTIN_TOOL_PARSERS``) and, registered
here, mlx-lm's own parsers, wrapped rather than rewritten. The text engine
picks one per load (``tool_call_format``) and hands it to the output pipeline.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

from mlxd.generation.params import ToolSpec
from mlxd.generation.registry import NamedRegistry
from mlxd.generation.tools import (
    BUILTIN_TOOL_PARSERS,
    ParsedCall,
    ParseFn,
    ToolCallFormat,
    ToolParseError,
    calls_from_json_value,
    tool_parser,
)

TOOL_PARSERS: NamedRegistry[ToolCallFormat] = NamedRegistry(
    "tool-call parser", BUILTIN_TOOL_PARSERS)


def _mlx_lm_parser(module_name: str) -> ParseFn:
    """Parse with ``mlx_lm.tool_parsers.<module_name>`` (imported on first use: it loads MLX)."""

    def parse(text: str, tools: list[ToolSpec] | None = None) -> list[ParsedCall]:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
        openai_tools = [t.as_openai() for t in tools or []]
        try:
            parsed = module.parse_tool_call(text, openai_tools)
        except (ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            raise ToolParseError(f"{module_name}: {e}") from e
        return calls_from_json_value(parsed)

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


def _register_mlx_lm_formats() -> None:
    for module, start, end, families in _MLX_LM_FORMATS:
        tool_parser(TOOL_PARSERS, module, start, end, families,
                    json_body=module == "json_tools")(_mlx_lm_parser(module))


_register_mlx_lm_formats()


def mlx_lm_tool_parser(tokenizer: Any) -> str | None:
    """The parser mlx-lm's tokenizer loader detected (or read from the checkpoint), if any."""
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    return init_kwargs.get("tool_parser_type") if isinstance(init_kwargs, dict) else None


def detect_tool_format(chat_template: str | None, mlx_lm_parser: str | None = None) -> ToolCallFormat:
    """Pick the format for a model: mlx-lm's own detection first, then template
    markers; models whose template knows no tools get ``hermes`` (mlxd then
    describes the tools in a system message)."""
    if mlx_lm_parser == "json_tools":
        return TOOL_PARSERS["hermes"]
    if mlx_lm_parser and mlx_lm_parser in TOOL_PARSERS:
        return TOOL_PARSERS[mlx_lm_parser]
    template = chat_template or ""
    if "<|python_tag|>" in template or re.search(r"\"parameters\"\s*:\s*", template):
        return TOOL_PARSERS["llama3_json"]
    if "[TOOL_CALLS]" in template:
        return TOOL_PARSERS["mistral"]
    return TOOL_PARSERS["hermes"]


def tool_call_format(name: str | None, tokenizer: Any) -> ToolCallFormat:
    """Resolve ``--tool-call-parser NAME``, or detect from ``tokenizer`` when None/"auto"."""
    if name and name != "auto":
        return TOOL_PARSERS.named(name)
    template = getattr(tokenizer, "chat_template", None)
    return detect_tool_format(template if isinstance(template, str) else None,
                              mlx_lm_tool_parser(tokenizer))
