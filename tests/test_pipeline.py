"""The output pipeline on scripted token streams: markup split across tokens never leaks."""

from __future__ import annotations

import json

import pytest

from mlxd.engines.text.tool_parsers import TOOL_PARSERS
from mlxd.generation.detokenizer import IncrementalDetokenizer
from mlxd.generation.events import Finish, ReasoningDelta, TextDelta, ToolCall
from mlxd.generation.params import ToolSpec
from mlxd.generation.pipeline import OutputPipeline, PipelineOptions
from mlxd.generation.reasoning import REASONING_PARSERS
from tests.helpers.scripted import PieceTokenizer, char_pieces, split_all_ways

THINK = REASONING_PARSERS["think"]
HERMES = TOOL_PARSERS["hermes"]
TOOLS = [ToolSpec("get_weather", None, {"type": "object", "properties": {}})]


def run(pieces: list[str], finish: str = "stop", **opts: object) -> dict[str, object]:
    tok = PieceTokenizer()
    ids = [tok.add(p) for p in pieces]
    pipe = OutputPipeline(IncrementalDetokenizer(tok), PipelineOptions(**opts))  # type: ignore[arg-type]
    events = []
    for i in ids:
        events += pipe.feed(i)
        if pipe.stopped:
            break
    events += pipe.finish(finish)
    return {
        "content": "".join(e.text for e in events if isinstance(e, TextDelta)),
        "reasoning": "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "calls": [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)],
        "finish": next(e for e in events if isinstance(e, Finish)),
        "events": events,
    }


def test_plain_text_passes_through_unchanged_at_every_split() -> None:
    text = "Hello, world! 12 < 13 > 9"
    for pieces in split_all_ways(text):
        out = run(pieces)
        assert out["content"] == text
        assert out["finish"].reason == "stop"  # type: ignore[union-attr]


def test_stop_string_split_across_tokens_never_leaks() -> None:
    text = "The answer is 42.\nEND of text after"
    for pieces in split_all_ways(text):
        out = run(pieces, stop=["\nEND"])
        assert out["content"] == "The answer is 42."
        assert out["finish"].stop_sequence == "\nEND"  # type: ignore[union-attr]


def test_partial_stop_prefix_is_released_when_it_does_not_match() -> None:
    out = run(char_pieces("a\nENx"), stop=["\nEND"], finish="length")
    assert out["content"] == "a\nENx"
    assert out["finish"].reason == "length"  # type: ignore[union-attr]


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    out = run(char_pieces("abcSTOPdef"), stop=["STOP"], include_stop_str_in_output=True)
    assert out["content"] == "abcSTOP"


def test_reasoning_split_at_every_boundary() -> None:
    text = "<think>Let me think: 2+2.</think>\n\nThe answer is 4."
    for pieces in split_all_ways(text):
        out = run(pieces, reasoning=THINK)
        assert out["reasoning"] == "Let me think: 2+2."
        assert out["content"] == "The answer is 4."
        assert "<think>" not in str(out["content"]) + str(out["reasoning"])


def test_reasoning_opened_by_the_prompt_starts_in_reasoning() -> None:
    text = "step one</think>Done."
    for pieces in split_all_ways(text):
        out = run(pieces, reasoning=THINK, start_in_reasoning=True)
        assert out == {**out, "reasoning": "step one", "content": "Done."}


def test_prompt_detection_of_an_open_think_block() -> None:
    assert THINK.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not THINK.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.starts_inside("<|im_start|>assistant\n")


def test_unterminated_reasoning_is_reported_as_reasoning() -> None:
    out = run(char_pieces("<think>still thinking"), reasoning=THINK, finish="length")
    assert out["reasoning"] == "still thinking"
    assert out["content"] == ""


def test_hermes_tool_call_split_at_every_boundary() -> None:
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for pieces in split_all_ways(text):
        out = run(pieces, tool_format=HERMES, tools=TOOLS)
        assert out["content"] == "Sure."
        assert out["calls"] == [("get_weather", {"city": "Paris"})]
        assert out["finish"].reason == "tool_calls"  # type: ignore[union-attr]


def test_two_tool_calls_in_one_turn_have_unique_ids() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    out = run(char_pieces(call % "Paris" + "\n" + call % "Rome"), tool_format=HERMES, tools=TOOLS)
    calls = [e for e in out["events"] if isinstance(e, ToolCall)]  # type: ignore[attr-defined]
    assert [c.index for c in calls] == [0, 1]
    assert len({c.id for c in calls}) == 2
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def test_reasoning_then_tool_call() -> None:
    text = ('<think>need weather</think><tool_call>{"name": "get_weather", '
            '"arguments": {}}</tool_call>')
    for pieces in split_all_ways(text, max_cuts=1):
        out = run(pieces, reasoning=THINK, tool_format=HERMES, tools=TOOLS)
        assert out["reasoning"] == "need weather"
        assert out["content"] == ""
        assert out["calls"] == [("get_weather", {})]


def test_unparseable_tool_markup_is_returned_as_text_not_lost() -> None:
    text = "<tool_call>not json</tool_call>"
    out = run(char_pieces(text), tool_format=HERMES, tools=TOOLS)
    assert out["calls"] == []
    assert out["content"] == text


def test_llama3_bare_json_call() -> None:
    fmt = TOOL_PARSERS["llama3_json"]
    text = '  {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for pieces in split_all_ways(text, max_cuts=1):
        out = run(pieces, tool_format=fmt, tools=TOOLS)
        assert out["calls"] == [("get_weather", {"city": "Oslo"})]
        assert out["content"] == ""


def test_llama3_plain_answer_is_content() -> None:
    out = run(char_pieces("It is sunny."), tool_format=TOOL_PARSERS["llama3_json"], tools=TOOLS)
    assert out["content"] == "It is sunny."


def test_mistral_tool_calls_use_mlx_lm_parser() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]'
    out = run(char_pieces(text), tool_format=TOOL_PARSERS["mistral"], tools=TOOLS)
    assert out["calls"] == [("get_weather", {"city": "Bern"})]


def test_tool_markup_is_plain_text_when_no_tools_were_given() -> None:
    text = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    assert run(char_pieces(text))["content"] == text


def test_usage_counts_tokens_and_reasoning_tokens() -> None:
    out = run(char_pieces("<think>ab</think>cd"), reasoning=THINK, prompt_tokens=7)
    usage = out["finish"].usage  # type: ignore[union-attr]
    assert usage.prompt_tokens == 7
    assert usage.completion_tokens == len("<think>ab</think>cd")
    assert usage.reasoning_tokens == len("ab</think>")  # tokens fed inside the block


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"llama3_json"}))
def test_tool_formats_mirror_mlx_lm_markers(name: str) -> None:
    """Our table of mlx-lm formats (llama3_json is ours alone) must agree with mlx-lm."""
    import importlib

    fmt = TOOL_PARSERS[name]
    module_name = {"hermes": "json_tools"}.get(name, name)
    module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
    assert (fmt.start, fmt.end) == (module.tool_call_start, module.tool_call_end)
