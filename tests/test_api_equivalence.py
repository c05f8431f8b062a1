"""One pipeline, three APIs: the same generation reads the same in each.

The same scripted token stream (fed through the engine's real output
pipeline, see ``tests/helpers/scripted_engine.py``) is requested through
OpenAI chat, the Responses API and Anthropic Messages, streaming and not;
the content, reasoning, tool calls and finish reason each client sees must
agree. And the same conversation, written in each API's own shape, must
render the same prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.helpers.scripted_engine import ScriptedLoader

MODEL = "agent"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Weather for a city."
ASK = "Weather in Paris?"

SCRIPTS = {
    "plain text": ("Hello there, friend.", 64),
    "reasoning then text": ("<think>Two and two.</think>The answer is 4.", 64),
    "text then a call": ('Let me check.<tool_call>{"name": "get_weather", "arguments": '
                         '{"city": "Paris"}}</tool_call>', 64),
    "reasoning and two calls": ('<think>Both cities.</think><tool_call>{"name": "get_weather", '
                                '"arguments": {"city": "Paris"}}</tool_call><tool_call>'
                                '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                '</tool_call>', 96),
    "cut by max tokens": ("one two three four five six seven eight nine ten", 4),
}

Seen = dict[str, Any]  # {"reasoning", "content", "calls", "finish"}


def seen(reasoning: str, content: str, calls: list[tuple[str, Any]], finish: str) -> Seen:
    return {"reasoning": reasoning, "content": content, "calls": calls, "finish": finish}


# -- what each client sees ---------------------------------------------------------

def chat(oai: OpenAI, max_tokens: int) -> Seen:
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens,
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": DESCRIPTION,
                                                 "parameters": PARAMS}}])
    m = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return seen(getattr(m, "reasoning_content", None) or "", m.content or "", calls,
                r.choices[0].finish_reason)


def chat_stream(oai: OpenAI, max_tokens: int) -> Seen:
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens,
        stream=True, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}}])
    reasoning, content, calls, finish = "", "", {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                calls[call.index] = (call.function.name, json.loads(call.function.arguments))
            finish = choice.finish_reason or finish
    return seen(reasoning, content, [calls[i] for i in sorted(calls)], finish)


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": DESCRIPTION,
                    "parameters": PARAMS}]


def _responses_seen(r: Any) -> Seen:
    reasoning, content, calls = "", "", []
    for item in r.output:
        if item.type == "reasoning":
            reasoning += "".join(c.text for c in item.content or [])
        elif item.type == "message":
            content += "".join(c.text for c in item.content)
        elif item.type == "function_call":
            calls.append((item.name, json.loads(item.arguments)))
    finish = "length" if r.status == "incomplete" else ("tool_calls" if calls else "stop")
    return seen(reasoning, content, calls, finish)


def responses(oai: OpenAI, max_tokens: int) -> Seen:
    return _responses_seen(oai.responses.create(
        model=MODEL, input=ASK, max_output_tokens=max_tokens, tools=RESPONSES_TOOLS))


def responses_stream(oai: OpenAI, max_tokens: int) -> Seen:
    with oai.responses.stream(model=MODEL, input=ASK, max_output_tokens=max_tokens,
                              tools=RESPONSES_TOOLS) as stream:
        final = [e.response for e in stream
                 if e.type in ("response.completed", "response.incomplete")]
    assert len(final) == 1
    return _responses_seen(final[0])


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS}]
ANTHROPIC_FINISH = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def _anthropic_seen(m: Any) -> Seen:
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    content = "".join(b.text for b in m.content if b.type == "text")
    calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    return seen(reasoning, content, calls, ANTHROPIC_FINISH[m.stop_reason])


def messages(claude: anthropic.Anthropic, max_tokens: int) -> Seen:
    return _anthropic_seen(claude.messages.create(
        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": ASK}],
        tools=ANTHROPIC_TOOLS))


def messages_stream(claude: anthropic.Anthropic, max_tokens: int) -> Seen:
    with claude.messages.stream(model=MODEL, max_tokens=max_tokens, tools=ANTHROPIC_TOOLS,
                                messages=[{"role": "user", "content": ASK}]) as stream:
        return _anthropic_seen(stream.get_final_message())


OPENAI_PATHS: dict[str, Callable[[OpenAI, int], Seen]] = {
    "chat": chat, "chat stream": chat_stream,
    "responses": responses, "responses stream": responses_stream}
ANTHROPIC_PATHS: dict[str, Callable[[anthropic.Anthropic, int], Seen]] = {
    "messages": messages, "messages stream": messages_stream}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_same_generation_reads_the_same_in_every_api(
        script: str, loader: ScriptedLoader, oai: OpenAI, claude: anthropic.Anthropic) -> None:
    loader.reply, max_tokens = SCRIPTS[script]
    results = {name: path(oai, max_tokens) for name, path in OPENAI_PATHS.items()}
    results.update({name: path(claude, max_tokens) for name, path in ANTHROPIC_PATHS.items()})
    expected = results["chat"]
    for name, got in results.items():
        assert got == expected, f"{name} differs from chat:\n{got}\n{expected}"
        assert "<think>" not in got["content"] and "<tool_call>" not in got["content"]


def test_scripts_exercise_reasoning_calls_and_truncation(
        loader: ScriptedLoader, oai: OpenAI) -> None:
    """Guard: the equivalence above compares something (not all-empty answers)."""
    got = {}
    for script, (reply, max_tokens) in SCRIPTS.items():
        loader.reply = reply
        got[script] = chat(oai, max_tokens)
    assert got["reasoning then text"] == seen("Two and two.", "The answer is 4.", [], "stop")
    assert got["reasoning and two calls"] == seen(
        "Both cities.", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
        "tool_calls")
    assert got["text then a call"]["calls"] == [("get_weather", {"city": "Paris"})]
    assert got["cut by max tokens"]["finish"] == "length"


# -- the same conversation renders the same prompt ---------------------------------------

def chat_conversation(oai: OpenAI, choice: Any) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    oai.chat.completions.create(model=MODEL, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks. And Oslo?"}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": DESCRIPTION,
                                                 "parameters": PARAMS}}], **extra)


def responses_conversation(oai: OpenAI, choice: Any) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    oai.responses.create(model=MODEL, max_output_tokens=8, instructions="Be brief.", input=[
        {"role": "user", "content": ASK},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need weather."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "Thanks. And Oslo?"}],
        tools=RESPONSES_TOOLS, store=False, **extra)


def messages_conversation(claude: anthropic.Anthropic, choice: Any) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    claude.messages.create(model=MODEL, max_tokens=8, system="Be brief.", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need weather.", "signature": ""},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
            {"type": "text", "text": "Thanks. And Oslo?"}]}],
        tools=ANTHROPIC_TOOLS, **extra)


CHOICES = {  # (chat, responses, anthropic)
    "default": (None, None, None),
    "auto": ("auto", "auto", {"type": "auto"}),
    "required": ("required", "required", {"type": "any"}),
    "named": ({"type": "function", "function": {"name": "get_weather"}},
              {"type": "function", "name": "get_weather"},
              {"type": "tool", "name": "get_weather"}),
    "none": ("none", "none", {"type": "none"}),
}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_same_conversation_renders_the_same_prompt_in_every_api(
        choice: str, loader: ScriptedLoader, oai: OpenAI, claude: anthropic.Anthropic) -> None:
    loader.reply = "ok"
    chat_choice, responses_choice, anthropic_choice = CHOICES[choice]
    chat_conversation(oai, chat_choice)
    responses_conversation(oai, responses_choice)
    messages_conversation(claude, anthropic_choice)
    chat_prompt, responses_prompt, anthropic_prompt = loader.prompts[-3:]
    assert responses_prompt == chat_prompt
    assert anthropic_prompt == chat_prompt
    for part in ("Be brief.", ASK, "<think>Need weather.</think>", "Let me check.",
                 '<tool_response id="call_1">sunny</tool_response>', "Thanks. And Oslo?"):
        assert part in chat_prompt
    assert ("get_weather" in chat_prompt.split(ASK)[0]) == (choice != "none")


def test_count_tokens_equals_the_chat_prompt_tokens(
        loader: ScriptedLoader, oai: OpenAI, claude: anthropic.Anthropic) -> None:
    loader.reply = "ok"
    convo = [{"role": "user", "content": ASK}]
    chat_usage = oai.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "system", "content": "Be brief."}, *convo],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": DESCRIPTION,
                                                 "parameters": PARAMS}}]).usage
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=convo,
                                           tools=ANTHROPIC_TOOLS)
    responses_usage = oai.responses.create(model=MODEL, instructions="Be brief.", input=ASK,
                                           tools=RESPONSES_TOOLS, max_output_tokens=2,
                                           store=False).usage
    assert counted.input_tokens == chat_usage.prompt_tokens == responses_usage.input_tokens
