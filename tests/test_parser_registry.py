"""Tool-call and reasoning parsers are registered by name and chosen by flag or by the tokenizer."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlxd.engines.text.tool_parsers import TOOL_PARSERS, detect_tool_format, tool_call_format
from mlxd.generation.reasoning import REASONING_PARSERS, ReasoningFormat, reasoning_format
from mlxd.generation.registry import NamedRegistry
from mlxd.generation.tools import BUILTIN_TOOL_PARSERS

# Every name --tool-call-parser accepted before parsers became a registry, in order.
TOOL_NAMES = ["hermes", "llama3_json", "json_tools", "qwen3_coder", "mistral", "pythonic",
              "glm47", "laguna", "minimax_m2", "kimi_k2", "kimi_k3", "function_gemma", "gemma4",
              "longcat", "minicpm5", "muse_spark"]
REASONING_NAMES = ["think", "qwen3", "deepseek_r1", "longcat", "think_tokens", "gemma_channel"]


@dataclass
class Tokenizer:
    """What tool-format detection reads from mlx-lm's tokenizer wrapper."""

    chat_template: str | None = None
    init_kwargs: dict[str, Any] = field(default_factory=dict)


def test_every_parser_name_is_registered_in_order() -> None:
    assert list(TOOL_PARSERS) == TOOL_NAMES
    assert list(REASONING_PARSERS) == REASONING_NAMES


def test_backend_free_registry_holds_only_our_json_formats() -> None:
    """generation/ registers what it parses itself; mlx-lm's parsers live in engines/."""
    assert list(BUILTIN_TOOL_PARSERS) == ["hermes", "llama3_json"]
    assert all(f.parse.__module__ == "mlxd.generation.tools"
               for f in BUILTIN_TOOL_PARSERS.values())
    assert TOOL_PARSERS["hermes"] is BUILTIN_TOOL_PARSERS["hermes"]
    assert TOOL_PARSERS["mistral"].parse.__module__ == "mlxd.engines.text.tool_parsers"


def test_generation_parsers_work_without_loading_mlx_lm() -> None:
    code = ("import sys\n"
            "from mlxd.generation.tools import BUILTIN_TOOL_PARSERS as R\n"
            "import mlxd.generation.pipeline, mlxd.generation.structured\n"
            "calls = R['hermes'].parse('{\"name\": \"f\", \"arguments\": {}}', [])\n"
            "assert calls == [{'name': 'f', 'arguments': {}}], calls\n"
            "assert 'mlx_lm' not in sys.modules and 'mlx' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_names_are_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown tool-call parser 'nope'. Known: hermes, "):
        tool_call_format("nope", Tokenizer())
    with pytest.raises(ValueError, match=r"Unknown reasoning parser 'nope'.*gemma_channel, none"):
        reasoning_format("nope")


def test_a_name_registers_once() -> None:
    registry: NamedRegistry[ReasoningFormat] = NamedRegistry("reasoning parser", REASONING_PARSERS)
    with pytest.raises(ValueError, match="registered twice"):
        registry.add(ReasoningFormat("think", "<t>", "</t>", "a second think"))
    mine = registry.add(ReasoningFormat("mine", "<t>", "</t>", "added on top"))
    assert registry["mine"] is mine and "mine" not in REASONING_PARSERS
    assert list(registry) == [*REASONING_NAMES, "mine"]


def test_a_named_parser_wins_over_detection() -> None:
    tok = Tokenizer("[TOOL_CALLS]", {"tool_parser_type": "mistral"})
    assert tool_call_format("pythonic", tok).name == "pythonic"
    assert tool_call_format("auto", tok).name == "mistral"
    assert tool_call_format(None, tok).name == "mistral"


@pytest.mark.parametrize("template,detected,name", [
    (None, "kimi_k2", "kimi_k2"),  # mlx-lm's detection first
    (None, "json_tools", "hermes"),  # mlx-lm's JSON-in-<tool_call> is our hermes
    ("{{ '<|python_tag|>' }}", None, "llama3_json"),
    ('{"name": x, "parameters": y}', None, "llama3_json"),
    ("[TOOL_CALLS]", None, "mistral"),
    ("{{ messages }}", None, "hermes"),  # no tool markup: mlxd describes the tools itself
    (None, "unknown_to_us", "hermes"),
])
def test_detection_from_the_tokenizer(template: str | None, detected: str | None,
                                      name: str) -> None:
    kwargs = {"tool_parser_type": detected} if detected else {}
    assert tool_call_format(None, Tokenizer(template, kwargs)).name == name
    assert detect_tool_format(template, detected).name == name


def test_reasoning_markers_detected_from_the_tokenizer() -> None:
    assert reasoning_format(None, ("<think>", "</think>")) is REASONING_PARSERS["think"]
    fmt = reasoning_format(None, ("<r>", "</r>"))
    assert fmt is not None and (fmt.name, fmt.start, fmt.end) == ("detected", "<r>", "</r>")
    assert reasoning_format("none", ("<think>", "</think>")) is None
    assert reasoning_format(None) is None
