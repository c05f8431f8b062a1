"""What one generation asks for, independent of the API it came through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class SamplingParams:
    """Sampling settings; defaults mean "off" (temperature 1.0 is OpenAI's default)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SamplingChoices:
    """The sampling values a client gave, None where it gave none (``top_k`` -1: off).

    The server resolves them once, under the model's lease, with the model's registry
    defaults into the ``SamplingParams`` the engine reads
    (``server/request_policy.apply_serving_defaults``).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


@dataclass(frozen=True)
class InputGrammar:
    """The grammar a freeform tool's input follows: ``syntax`` ``lark`` or ``regex``."""

    syntax: Literal["lark", "regex"]
    definition: str


FREEFORM_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
    "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call (OpenAI ``function`` / Anthropic ``tool``).

    ``freeform``: a Responses ``custom`` tool whose call is plain text. The model
    sees it as a function with one string parameter, ``input``; a call forced by
    ``tool_choice`` writes the text raw after the tool's name and a newline,
    under ``grammar`` when the tool has one.
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    freeform: bool = False
    grammar: InputGrammar | None = None

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``auto`` / ``none`` / ``required``, or one named function (``mode="function"``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class Constraint:
    """Structured-output constraint, compiled by the engine into a token mask.

    kind: ``json_schema`` (value: the schema dict), ``json_object`` (value
    None), ``regex`` (a pattern), or ``grammar`` / ``lark`` (a Lark grammar;
    ``lark`` is also what a forced tool call compiles to), or ``llguidance``
    (a TopLevelGrammar JSON: a forced call of a freeform tool with its grammar).
    """

    kind: Literal["json_schema", "json_object", "regex", "grammar", "lark", "llguidance"]
    value: Any = None


@dataclass(frozen=True)
class CacheMark:
    """Keep the prompt's prefix up to the end of its first ``messages`` messages (0: the
    system prompt and the tools alone) in the prefix cache for ``ttl_s`` seconds
    (Anthropic's ``cache_control``)."""

    messages: int
    ttl_s: float


@dataclass
class GenerationRequest:
    """One request to a text engine. Exactly one of ``messages``/``prompt`` is set."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # What the client chose, before the registry's defaults: set by the API adapters and
    # resolved into ``sampling`` when the request is leased (None: ``sampling`` is final).
    sampling_choices: SamplingChoices | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    constraint: Constraint | None = None
    # the client's; the registry entry's are merged under them when the request is leased
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Keeps this request's prefix-cache entries apart from requests with another
    # salt (vLLM's ``cache_salt``); None shares with every unsalted request.
    cache_salt: str | None = None
    # Requests with the same key share a prompt prefix worth keeping (OpenAI's
    # ``prompt_cache_key``): the prefix cache keeps it resident ahead of LRU eviction.
    cache_key: str | None = None
    cache_marks: list[CacheMark] = field(default_factory=list)
    # The LoRA adapter (its served name) the request runs with; set by the server from
    # the requested model name, never by a client. None: the base model.
    adapter: str | None = None
