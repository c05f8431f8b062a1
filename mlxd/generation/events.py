"""Events the pipeline emits; each API adapter turns them into its wire format."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LOGPROB_FLOOR = -9999.0
"""The log-probability reported for a token the sampled distribution rules out
(masked by constrained decoding or ``logit_bias``, or made non-finite by an
extreme penalty): OpenAI's and vLLM's value. JSON has no ``-Infinity``/``NaN``."""


def finite_logprob(value: float) -> float:
    """``value`` as a reportable log-probability: within ``[LOGPROB_FLOOR, 0]``, never NaN."""
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]

    def __post_init__(self) -> None:
        # Every producer (scheduler, prompt logprobs, later engines) goes through here.
        object.__setattr__(self, "logprob", finite_logprob(self.logprob))


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token with its log-probability and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.logprob is not None:  # None: echo's first prompt token has none
            object.__setattr__(self, "logprob", finite_logprob(self.logprob))


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A tool call. ``complete``: ``arguments`` is a valid JSON document (plain text for a
    ``freeform`` call). A call cut
    off by ``max_tokens`` has ``complete=False`` and ``arguments`` as far as the model
    generated them (a JSON prefix, possibly empty)."""

    index: int
    id: str
    name: str
    arguments: str
    complete: bool = True
    # A freeform (Responses ``custom``) tool's call: ``arguments`` is its plain-text input.
    freeform: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # speculative decoding: draft tokens the model confirmed / refused (OpenAI's names)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finish:
    """The end of one sequence. ``reason``: stop, length, tool_calls, cancelled or error.

    ``queue_seconds``: how long the sequence waited for a place in the running batch
    (None when it never got one)."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None
    error: str | None = None
    queue_seconds: float | None = None


Event = TextDelta | ReasoningDelta | ToolCall | Finish
