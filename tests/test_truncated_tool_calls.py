"""A tool call cut off by ``max_tokens`` is a tool call, never markup in content
(issue 16, item 8).

OpenAI chat returns it in ``tool_calls`` with ``finish_reason: length`` and the
arguments as far as they were generated; the Responses API as a
``function_call`` item with ``status: incomplete``; Anthropic Messages as a
``tool_use`` block whose ``input`` is the best-effort object read from the
partial arguments, with ``stop_reason: max_tokens``. Scripted generations run
the real pipeline and adapters (``tests/helpers/scripted_engine.py``); the
forced-call cases generate for real under the tool-call grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from mlxd.engines.text.tool_parsers import TOOL_PARSERS
from mlxd.generation.detokenizer import IncrementalDetokenizer
from mlxd.generation.events import Finish, TextDelta, ToolCall
from mlxd.generation.params import ToolSpec
from mlxd.generation.pipeline import OutputPipeline, PipelineOptions
from mlxd.generation.truncated import parse_partial_json
from tests.helpers.scripted import PieceTokenizer, char_pieces
from tests.helpers.scripted_engine import ScriptedLoader

MODEL = "agent"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMS}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CUT_AT = '{"city": "Pa'  # the scripted reply is cut inside the arguments' string value


# -- the pipeline --------------------------------------------------------------------

def run(text: str, finish: str, fmt: str = "hermes",
        tools: tuple[str, ...] = ("get_weather",)) -> list[Any]:
    tok = PieceTokenizer()
    pipe = OutputPipeline(IncrementalDetokenizer(tok), PipelineOptions(
        tool_format=TOOL_PARSERS[fmt], tools=[ToolSpec(t, None, PARAMS) for t in tools]))
    events: list[Any] = []
    for piece in char_pieces(text):
        events += pipe.feed(tok.add(piece))
    return events + pipe.finish(finish)


def parts(events: list[Any]) -> tuple[str, list[ToolCall], str]:
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return content, calls, next(e for e in events if isinstance(e, Finish)).reason


@pytest.mark.parametrize("cut", range(len("<tool_call>"), len(CALL) - len("</tool_call>")))
def test_a_hermes_call_cut_anywhere_is_a_call_not_content(cut: int) -> None:
    content, calls, reason = parts(run("Let me check." + CALL[:cut], "length"))
    assert content == "Let me check."
    assert reason == "length"
    body = CALL[len("<tool_call>"):cut]
    if not body:
        assert calls == []  # only the marker: nothing of a call to return
        return
    # Once the body starts, the one tool offered is the one being called.
    assert [c.name for c in calls] == ["get_weather"]
    generated = body.split('"arguments": ', 1)[1] if '"arguments": ' in body else ""
    assert calls[0].arguments == generated.rstrip()
    assert calls[0].complete == (generated == '{"city": "Paris"}')


def test_a_cut_call_keeps_the_calls_completed_before_it() -> None:
    text = CALL + '<tool_call>{"name": "get_time", "arguments": {"tz": "Eur'
    content, calls, reason = parts(run(text, "length", tools=("get_weather", "get_time")))
    assert content == "" and reason == "length"
    assert [(c.name, c.arguments, c.complete) for c in calls] == [
        ("get_weather", '{"city": "Paris"}', True), ("get_time", '{"tz": "Eur', False)]


def test_a_partial_name_resolves_only_to_a_unique_tool() -> None:
    text = '<tool_call>{"name": "get_w'
    _, calls, _ = parts(run(text, "length", tools=("get_weather", "get_time")))
    assert [c.name for c in calls] == ["get_weather"]
    _, calls, _ = parts(run('<tool_call>{"name": "get_', "length",
                            tools=("get_weather", "get_time")))
    assert calls == []


@pytest.mark.parametrize("fmt,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'),
])
def test_formats_without_an_end_marker_salvage_a_cut_call(fmt: str, text: str) -> None:
    content, calls, reason = parts(run(text, "length", fmt=fmt))
    assert content == "" and reason == "length"
    assert [(c.name, c.arguments, c.complete) for c in calls] == [
        ("get_weather", '{"city": "Pa', False)]


def test_unclosed_markup_at_a_natural_stop_gets_no_invented_end_marker() -> None:
    content, calls, reason = parts(run("<tool_call>not json", "stop"))
    assert (content, calls, reason) == ("<tool_call>not json", [], "stop")


@pytest.mark.parametrize("prefix,value", [
    ('{"city": "Pa', {"city": "Pa"}),
    ('{"city": "Paris", "days', {"city": "Paris"}),
    ('{"city": "Paris", "days": ', {"city": "Paris"}),
    ('{"city": "Paris", "days": 3', {"city": "Paris", "days": 3}),
    ('{"a": [1, {"b": tr', {"a": [1, {}]}),
    ('{"a": "x\\', {"a": "x"}),
    ('{"a": "\\u00', {}),
    ('{', {}),
    ('', None),
    ('{"a": 1}', {"a": 1}),
])
def test_partial_json_is_read_as_far_as_it_goes(prefix: str, value: Any) -> None:
    assert parse_partial_json(prefix) == value


# -- the three APIs, streaming and not, through the real SDKs ------------------------------

@dataclass(frozen=True)
class Cut:
    max_tokens: int  # cuts the scripted CALL inside its arguments
    arguments: str  # the arguments generated by then


@pytest.fixture(scope="module")
def cut(agent_model: Path) -> Cut:
    """Where ``max_tokens`` cuts ``CALL`` in the agent model's own tokens: inside ``CUT_AT``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(agent_model))
    ids = tok.encode(CALL, add_special_tokens=False)
    want = CALL.index(CUT_AT) + len(CUT_AT)
    n = next(n for n in range(1, len(ids)) if len(tok.decode(ids[:n])) >= want)
    arguments = tok.decode(ids[:n]).split('"arguments": ', 1)[1]
    assert not arguments.endswith("}")  # the cut is really inside the arguments
    return Cut(n, arguments)


@pytest.fixture
def cut_call(loader: ScriptedLoader, cut: Cut) -> Cut:
    loader.reply = CALL
    return cut


def check_chat(content: str | None, calls: list[tuple[str, str]], finish: str | None,
               cut: Cut) -> None:
    assert not content and finish == "length"
    assert calls == [("get_weather", cut.arguments)]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_chat_returns_a_cut_call_as_a_tool_call(choice: str, cut_call: Cut, oai: OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                    tool_choice=choice, max_tokens=cut_call.max_tokens)
    m = r.choices[0].message
    check_chat(m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
               r.choices[0].finish_reason, cut_call)


def test_streamed_chat_returns_a_cut_call_as_a_tool_call(cut_call: Cut, oai: OpenAI) -> None:
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                             max_tokens=cut_call.max_tokens, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                slot = calls.setdefault(c.index, ["", ""])
                slot[0] += c.function.name or ""
                slot[1] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    check_chat(content, [(n, a) for n, a in calls.values()], finish, cut_call)


def check_response(r: Any, cut: Cut) -> None:
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["function_call"]
    item = r.output[0]
    assert item.name == "get_weather" and item.status == "incomplete"
    assert item.arguments == cut.arguments


def test_responses_return_a_cut_call_as_an_incomplete_function_call(
        cut_call: Cut, oai: OpenAI) -> None:
    check_response(oai.responses.create(model=MODEL, input="Weather in Paris?",
                                        tools=RESPONSES_TOOLS,
                                        max_output_tokens=cut_call.max_tokens), cut_call)
    with oai.responses.stream(model=MODEL, input="Weather in Paris?",
                              tools=RESPONSES_TOOLS,
                              max_output_tokens=cut_call.max_tokens) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("function_call", "incomplete")]
    check_response(next(e.response for e in events if e.type == "response.incomplete"), cut_call)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_returns_a_cut_call_as_tool_use(
        stream: bool, cut_call: Cut, claude: anthropic.Anthropic) -> None:
    kw: Any = {"model": MODEL, "max_tokens": cut_call.max_tokens, "messages": ASK,
               "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kw)
    assert m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["tool_use"]
    block = m.content[0]
    assert block.name == "get_weather"
    assert block.input == parse_partial_json(cut_call.arguments)
    assert block.input["city"].startswith("P")


@pytest.mark.parametrize("max_tokens", [3, 6, 10])
def test_a_real_forced_call_cut_by_max_tokens_is_a_tool_call(
        max_tokens: int, loader: ScriptedLoader, oai: OpenAI) -> None:
    """No script: the tiny model generates under the tool-call grammar and is cut."""
    loader.reply = None
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                    tool_choice="required", max_tokens=max_tokens)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert "<tool_call>" not in (choice.message.content or "")
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]
