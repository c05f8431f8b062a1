"""Events the pipeline emits; each API adapter turns them into its wire format."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token with its log-probability and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call: ``arguments`` is always a valid JSON document."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finish:
    """The end of one sequence. ``reason``: stop, length, tool_calls, cancelled or error."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None
    error: str | None = None


Event = TextDelta | ReasoningDelta | ToolCall | Finish
