"""The output pipeline of one sequence: tokens in, API-neutral events out.

token ids -> incremental detokenizer -> stop strings -> reasoning split ->
tool-call parse -> ``TextDelta`` / ``ReasoningDelta`` / ``ToolCall`` /
``Finish``. The engine feeds it on the model's worker thread (stop strings
must end the sequence there); every API adapter consumes the same events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from mlxd.generation.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
    Usage,
)
from mlxd.generation.markup import MarkerScanner
from mlxd.generation.params import ToolSpec
from mlxd.generation.reasoning import ReasoningFormat
from mlxd.generation.stop import StopStringMatcher
from mlxd.generation.tools import ParsedCall, ToolCallFormat, ToolParseError
from mlxd.generation.truncated import salvage_calls


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizers satisfy this."""

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def last_segment(self) -> str: ...


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class PipelineOptions:
    """Per-request choices; the per-model parts (formats) come from the engine."""

    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    reasoning: ReasoningFormat | None = None
    start_in_reasoning: bool = False
    tool_format: ToolCallFormat | None = None  # None: tool markup is plain text
    tools: list[ToolSpec] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    id_factory: Callable[[], str] = new_tool_call_id


_CONTENT, _REASONING, _TOOL = "content", "reasoning", "tool"


class OutputPipeline:
    """Turns one sequence's tokens into events. Not thread-safe: one owner."""

    def __init__(self, detokenizer: Detokenizer, options: PipelineOptions) -> None:
        self._detok = detokenizer
        self._opt = options
        self._stop = StopStringMatcher(options.stop, options.include_stop_str_in_output)
        self._state = _REASONING if (options.reasoning and options.start_in_reasoning) else _CONTENT
        self._scanner = MarkerScanner(self._markers())
        self._tool_buffer = ""
        self._tool_calls = 0
        self._content_started = False
        self._after_reasoning = False
        self._lead_ws = ""  # leading whitespace held while a bare-JSON call may start
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.stop_sequence: str | None = None
        self.finished = False
        self.queue_seconds: float | None = None  # set by the scheduler on admission
        self.accepted_prediction_tokens = 0  # speculative decoding, set by the scheduler
        self.rejected_prediction_tokens = 0

    # -- public -----------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """A stop string matched: the engine must end this sequence now."""
        return self._stop.stopped

    def set_cached_tokens(self, n: int) -> None:
        """Record how many prompt tokens came from the prefix cache (for usage)."""
        self._opt.cached_tokens = n

    def feed(self, token_id: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """Consume one generated token (not the EOS that ended the sequence)."""
        self.completion_tokens += 1
        if self._state == _REASONING:
            self.reasoning_tokens += 1
        self._detok.add_token(token_id)
        events = self._route(self._detok.last_segment)
        return self._attach_logprob(events, logprob)

    def count_eos(self, logprob: TokenLogprob | None = None) -> list[Event]:
        """Count the token that ended the sequence without emitting its text."""
        self.completion_tokens += 1
        return self._attach_logprob([], logprob)

    def finish(self, reason: str, error: str | None = None) -> list[Event]:
        """Flush held-back text and emit ``Finish``. ``reason``: stop, length, cancelled, error."""
        if self.finished:
            return []
        self.finished = True
        events: list[Event] = []
        if not self._stop.stopped:
            self._detok.finalize()
            events += self._route(self._detok.last_segment)
            events += self._split(self._stop.flush(), final=True)
        if self._stop.stopped:
            reason = "stop"
        events += self._flush_split(truncated=reason == "length")
        if self._tool_calls and reason == "stop":
            reason = "tool_calls"
        usage = Usage(
            prompt_tokens=self._opt.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self._opt.cached_tokens,
            reasoning_tokens=self.reasoning_tokens,
            accepted_prediction_tokens=self.accepted_prediction_tokens,
            rejected_prediction_tokens=self.rejected_prediction_tokens,
        )
        events.append(Finish(reason, usage, self.stop_sequence, error, self.queue_seconds))
        return events

    # -- internals --------------------------------------------------------
    def _route(self, text: str) -> list[Event]:
        if not text:
            return []
        result = self._stop.feed(text)
        if result.stopped and result.stop_sequence:
            self.stop_sequence = result.stop_sequence
        return self._split(result.text, final=False)

    @staticmethod
    def _attach_logprob(events: list[Event], logprob: TokenLogprob | None) -> list[Event]:
        if logprob is None:
            return events
        for i, ev in enumerate(events):
            if isinstance(ev, TextDelta):
                events[i] = TextDelta(ev.text, [*(ev.logprobs or []), logprob])
                return events
        events.append(TextDelta("", [logprob]))
        return events

    def _markers(self) -> list[str]:
        opt = self._opt
        if self._state == _CONTENT:
            markers = []
            if opt.reasoning:
                markers.append(opt.reasoning.start)
            if opt.tool_format and opt.tool_format.start:
                markers.append(opt.tool_format.start)
            return markers
        if self._state == _REASONING:
            assert opt.reasoning is not None
            return [opt.reasoning.end]
        assert opt.tool_format is not None
        return [opt.tool_format.end] if opt.tool_format.end else []

    def _enter(self, state: str) -> None:
        self._state = state
        self._scanner.set_markers(self._markers())

    def _split(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._maybe_bare_json(text, final)
            if not text:
                break
            safe, marker, rest = self._scanner.feed(text)
            events += self._emit(safe)
            if marker is None:
                break
            events += self._transition(marker)
            text = rest
        return events

    def _maybe_bare_json(self, text: str, final: bool) -> str:
        """Llama-3 style calls start with a bare ``{``: switch to tool state then."""
        fmt = self._opt.tool_format
        if not (fmt and fmt.bare_json_start) or self._content_started or self._state != _CONTENT:
            return text
        text = self._lead_ws + text
        self._lead_ws = ""
        stripped = text.lstrip()
        if not stripped:
            if final:
                return text
            self._lead_ws = text
            return ""
        self._content_started = True
        if stripped.startswith("{"):
            self._enter(_TOOL)
            return stripped
        return text

    def _emit(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._state == _TOOL:
            self._tool_buffer += text
            return []
        if self._state == _REASONING:
            return [ReasoningDelta(text)]
        if self._after_reasoning:
            # Templates put blank lines after </think>; they are not content.
            text = text.lstrip()
            if not text:
                return []
            self._after_reasoning = False
        self._content_started = True
        return [TextDelta(text)]

    def _transition(self, marker: str) -> list[Event]:
        opt = self._opt
        if self._state == _CONTENT:
            if opt.reasoning and marker == opt.reasoning.start:
                self._enter(_REASONING)
            else:
                self._enter(_TOOL)
            return []
        if self._state == _REASONING:
            self._after_reasoning = True
            self._enter(_CONTENT)
            return []
        events = self._close_tool_call(closed=True)
        self._enter(_CONTENT)
        return events

    def _close_tool_call(self, closed: bool, truncated: bool = False) -> list[Event]:
        """Parse the buffered call. ``closed``: its end marker was generated;
        ``truncated``: ``max_tokens`` cut it off (what was generated is salvaged)."""
        fmt = self._opt.tool_format
        assert fmt is not None
        body, self._tool_buffer = self._tool_buffer, ""
        if not body.strip():
            return []
        raw = self._raw_freeform_call(body)
        if raw is not None:
            return self._tool_call_events([raw])
        try:
            calls = fmt.parse(body, self._opt.tools)
        except ToolParseError:
            if truncated:
                # Never markup in content: a cut-off call is a call, or nothing.
                return self._tool_call_events(self._salvage(body))
            # Unparseable markup is returned as text rather than lost.
            self._content_started = True
            return [TextDelta(fmt.start + body + (fmt.end if closed else ""))]
        return self._tool_call_events(calls)

    def _salvage(self, body: str) -> list[ParsedCall]:
        fmt = self._opt.tool_format
        assert fmt is not None
        if not (fmt.json_body or body.lstrip().startswith(("{", "["))):
            return []  # a truncated non-JSON body cannot be read reliably
        return salvage_calls(body, self._opt.tools)

    def _raw_freeform_call(self, body: str) -> ParsedCall | None:
        """A freeform tool's call written raw, as a forced call is: its name, a newline,
        then the input text (``ToolSpec.freeform``)."""
        for tool in self._opt.tools:
            if tool.freeform and body.startswith(tool.name + "\n"):
                return {"name": tool.name, "arguments": {"input": body[len(tool.name) + 1:]}}
        return None

    def _tool_call_events(self, calls: list[ParsedCall]) -> list[Event]:
        events: list[Event] = []
        freeform = {t.name for t in self._opt.tools if t.freeform}
        for call in calls:
            args = call["arguments"]
            text = _freeform_input(args) if call["name"] in freeform else None
            if text is not None:
                arguments, is_freeform = text, True  # the call's plain-text input
            else:
                is_freeform = False
                arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            events.append(ToolCall(self._tool_calls, call.get("id") or self._opt.id_factory(),
                                   call["name"], arguments, call.get("complete", True),
                                   freeform=is_freeform))
            self._tool_calls += 1
        return events

    def _flush_split(self, truncated: bool = False) -> list[Event]:
        events: list[Event] = []
        if self._lead_ws:
            text, self._lead_ws = self._lead_ws, ""
            events += self._emit(text)
        held = self._scanner.flush()
        if self._state == _TOOL:
            self._tool_buffer += held
            events += self._close_tool_call(closed=False, truncated=truncated)
            self._enter(_CONTENT)
        else:
            events += self._emit(held)
        return events


def _freeform_input(args: object) -> str | None:
    """A freeform tool's text from JSON arguments: ``input``, or the one string value a
    model put under another name (``{"patch": "..."}``)."""
    if not isinstance(args, dict):
        return None
    text = args.get("input")
    if isinstance(text, str):
        return text
    values = list(args.values())
    return values[0] if len(values) == 1 and isinstance(values[0], str) else None
