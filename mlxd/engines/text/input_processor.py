"""Prompt preparation: from a ``GenerationRequest`` to a ``PreparedPrompt``.

The stage vLLM calls the input processor. It renders chat messages with the
model's template (adding a tool prompt when the template cannot list tools),
tokenises with bounded work, checks every client-supplied token id and the
context limits, and compiles the grammar a request decodes under. It runs off
the event loop and never touches the model, so a text engine and a
vision-language engine share it: a vision processor overrides how message
content becomes template content (keeping image parts) and fills
``PreparedPrompt.media``; everything else is the same.

A prepared prompt is what a scheduler needs to decode and to key its prefix
cache: tokens, the media behind any placeholder tokens (each with a content
hash) and an optional cache salt.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from mlxd.engines.text.prompt_limits import (
    CHUNK_CHARS,
    char_bound,
    check_token_ids,
    count_chunked,
    reaches,
    text_chars,
)
from mlxd.engines.text.structured import GrammarTokenizer
from mlxd.errors import ContextOverflow, InvalidRequest
from mlxd.generation.chat import (
    content_text,
    fold_late_system,
    late_system_indices,
    template_messages,
    template_supports_tools,
    tools_system_prompt,
    with_tools_prompt,
)
from mlxd.generation.output_length import OutputLimit, output_limit
from mlxd.generation.params import GenerationRequest
from mlxd.generation.reasoning import ReasoningFormat
from mlxd.generation.structured import forced_tool_format, grammar_for, tool_call_constraint
from mlxd.generation.tools import ToolCallFormat

MediaKind = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class MediaItem:
    """One image, video or audio input behind a prompt's placeholder tokens.

    ``sha256`` identifies the content: two items with the same hash produce the
    same KV state, so it is part of the prefix-cache key. ``data`` holds the
    decoded bytes (or ``ref`` a path or URL) for the processor that encodes it.
    """

    kind: MediaKind
    sha256: str
    data: bytes | None = None
    ref: str | None = None

    @classmethod
    def from_bytes(cls, kind: MediaKind, data: bytes) -> MediaItem:
        """An item whose hash is computed from its bytes."""
        return cls(kind, hashlib.sha256(data).hexdigest(), data=data)


@dataclass
class PreparedPrompt:
    """A tokenised request, checked against the model's limits."""

    request: GenerationRequest
    tokens: list[int]
    prompt_text: str
    max_tokens: int
    stop_token_ids: set[int]
    start_in_reasoning: bool
    tool_format: ToolCallFormat | None
    grammar: str | None = None
    # ``max_tokens`` is the room the context leaves (a larger request was capped to it).
    context_limited: bool = False
    media: tuple[MediaItem, ...] = ()  # in prompt order; text models have none
    cache_salt: str | None = None  # separates prefix-cache entries (vLLM's cache_salt)
    cache_key: str | None = None  # keeps a shared prefix resident (``prompt_cache_key``)
    # (prefix length in tokens, seconds): prefixes to keep resident (``cache_control``)
    cache_pins: tuple[tuple[int, float], ...] = ()
    adapter_slot: int = 0  # the LoRA adapter the prompt runs with (0: the base model)
    # Token offsets inside the prompt worth a prefix-cache checkpoint (where the leading
    # system messages end), for models whose cache cannot be cut back to a prefix.
    checkpoints: tuple[int, ...] = ()
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def media_hashes(self) -> tuple[str, ...]:
        return tuple(m.sha256 for m in self.media)


@dataclass(frozen=True)
class InputLimits:
    """What a prompt is checked against, read from the model at load."""

    context_length: int
    vocab_size: int  # token ids a client may send: [0, vocab_size)
    token_chars: int = 64  # longest token in characters (bounds characters per token)


class InputProcessor:
    """Prepares text prompts for one loaded model (chat template, tools, limits, grammar).

    Built at each load from the tokenizer and the parsers chosen for it, so a
    reload never keeps a stale one. ``prepare`` is thread-safe: it reads only.
    """

    def __init__(self, name: str, tokenizer: Any, limits: InputLimits, *,
                 reasoning: ReasoningFormat | None, tool_format: ToolCallFormat | None,
                 grammar_tokenizer: GrammarTokenizer | None) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.limits = limits
        self.reasoning = reasoning
        self.tool_format = tool_format
        self.grammar_tokenizer = grammar_tokenizer
        # Set at load for hybrid models: their recurrent state cannot be trimmed, so a new
        # conversation reuses the shared system prompt only from a checkpoint at its end.
        self.checkpoint_system = False

    # -- the stage ---------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenise ``request`` and check it; every problem is a 400 before any decoding."""
        request = self._checked_sampling(request)
        fmt: ToolCallFormat | None = None
        media: tuple[MediaItem, ...] = ()
        checkpoints: tuple[int, ...] = ()
        if request.messages is not None:
            self._check_chars(text_chars(request.messages), "messages")  # before rendering
            messages, kwargs, fmt = self._template_input(request)
            text = self._apply_template(request, messages, kwargs)
            media = self.media_of(request.messages)
            tokens = self._encode(text, False, "messages")
            if self.checkpoint_system:
                checkpoints = self._system_end(messages, kwargs, tokens)
        elif isinstance(request.prompt, str):
            text = request.prompt
            tokens = self._encode(text, True, "prompt")
        else:
            tokens = list(request.prompt or [])
            if tokens:
                self._check_limits(len(tokens), None)
            check_token_ids(tokens, self.limits.vocab_size, "prompt")
            text = self.tokenizer.decode(tokens)
        if not tokens:
            raise InvalidRequest("The prompt is empty.", param="prompt")
        limit = self._check_limits(len(tokens), request.max_tokens)
        stop_ids = set(self.tokenizer.eos_token_ids) | set(request.stop_token_ids)
        start_in_reasoning = bool(self.reasoning and request.messages is not None
                                  and self.reasoning.starts_inside(text))
        return PreparedPrompt(request, tokens, text, limit.tokens, stop_ids, start_in_reasoning,
                              fmt, self._grammar(request, fmt),
                              context_limited=limit.context_limited, media=media,
                              cache_salt=request.cache_salt, cache_key=request.cache_key,
                              cache_pins=self._cache_pins(request, tokens),
                              checkpoints=checkpoints)

    def tokenize(self, request: GenerationRequest, add_special_tokens: bool) -> list[int]:
        """The token ids of ``request``'s prompt (text) or chat messages, rendered and
        bounded as ``prepare`` does (a prompt that cannot fit in the context is a 400);
        generation's checks (sampling, ``max_tokens``, grammar) are not made. An empty
        prompt is no error here: it has no tokens (or only the special ones)."""
        if request.messages is not None:
            self._check_chars(text_chars(request.messages), "messages")  # before rendering
            text, _, _ = self._render_chat(request)
            param = "messages"
        elif isinstance(request.prompt, str):
            text, param = request.prompt, "prompt"
        else:
            raise InvalidRequest("Give a prompt (text) or messages to tokenise.", param="prompt")
        tokens = self._encode(text, add_special_tokens, param)
        if len(tokens) >= self.limits.context_length:
            raise self._too_long(f"your prompt has {len(tokens)} tokens", param,
                                 tokens=len(tokens), counted=True)
        return tokens

    def token_strings(self, tokens: list[int]) -> list[str]:
        """Each id's vocabulary entry (vLLM's ``token_strs``: ``convert_ids_to_tokens``)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(tokens)]

    def decode(self, tokens: list[int]) -> str:
        """Client token ids as text, checked first: no more ids than the context holds,
        each in the vocabulary (a tokenizer raises or misbehaves on others)."""
        ctx = self.limits.context_length
        if len(tokens) > ctx:
            raise InvalidRequest(f"tokens has {len(tokens)} ids, more than this model's "
                                 f"context of {ctx} tokens.", param="tokens")
        check_token_ids(tokens, self.limits.vocab_size, "tokens")
        return cast(str, self.tokenizer.decode(tokens))

    def constraint_factory(self, grammar: str | None) -> Callable[[], list[Any]] | None:
        """Fresh logits processors for a sequence decoding under ``grammar`` (or None)."""
        if grammar is None or self.grammar_tokenizer is None:
            return None
        gt = self.grammar_tokenizer
        return lambda: [gt.processor(grammar)]

    # -- message content (a vision processor overrides these) -------------
    def content(self, content: Any, where: str) -> Any:
        """One message's content as its chat template takes it.

        Text models read text parts only; an image, audio, video or file part
        is a 400 naming the part.
        """
        return content_text(content, where=where)

    def media_of(self, messages: list[dict[str, Any]]) -> tuple[MediaItem, ...]:
        """The media items in ``messages``, in prompt order (none for a text model)."""
        return ()

    # -- steps -------------------------------------------------------------
    def _render_chat(self, request: GenerationRequest
                     ) -> tuple[str, ToolCallFormat | None, tuple[MediaItem, ...]]:
        messages, kwargs, fmt = self._template_input(request)
        return self._apply_template(request, messages, kwargs), fmt, \
            self.media_of(request.messages or [])

    def _template_input(self, request: GenerationRequest
                        ) -> tuple[list[dict[str, Any]], dict[str, Any], ToolCallFormat | None]:
        """The messages (tool descriptions included) and keyword arguments the chat
        template renders, and the tool-call format the answer is parsed with."""
        tok = self.tokenizer
        messages = template_messages(request.messages or [], content=self.content)
        use_tools = bool(request.tools) and request.tool_choice.mode != "none"
        fmt = self.tool_format if use_tools else None
        if use_tools and request.tool_choice.mode in ("required", "function"):
            fmt = forced_tool_format(fmt)
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs)
        if use_tools:
            assert fmt is not None
            if template_supports_tools(tok.chat_template) and request.tool_choice.mode == "auto":
                kwargs["tools"] = [t.as_openai() for t in request.tools]
            else:
                prompt = tools_system_prompt(request.tools, fmt, request.tool_choice)
                messages = with_tools_prompt(messages, prompt)
        return messages, kwargs, fmt

    def _apply_template(self, request: GenerationRequest, messages: list[dict[str, Any]],
                        kwargs: dict[str, Any]) -> str:
        """The rendered prompt. A system message after the first turn stays a system turn
        where the template renders it there; a template that refuses it or leaves it out
        gets it folded into the leading system message instead (``fold_late_system``)."""
        if self.tokenizer.chat_template is None:
            raise InvalidRequest(
                f"Model '{self.name}' has no chat template; use /v1/completions instead.")
        late = late_system_indices(messages)
        if late:
            try:
                text = self._render(request, messages, kwargs)
            except InvalidRequest:
                text = None
            texts = [messages[i]["content"] for i in late]
            if text is not None and all(isinstance(t, str) and t in text for t in texts):
                return text
            messages = fold_late_system(messages)
        return self._render(request, messages, kwargs)

    def _render(self, request: GenerationRequest, messages: list[dict[str, Any]],
                kwargs: dict[str, Any]) -> str:
        tok = self.tokenizer
        try:
            return cast(str, tok.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message, **kwargs))
        except Exception as e:  # jinja errors: roles must alternate, missing fields...
            raise InvalidRequest(f"The chat template rejected the messages: {e}",
                                 param="messages") from e

    def _system_end(self, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                    tokens: list[int]) -> tuple[int, ...]:
        """Where the prompt's leading system messages end (tool descriptions included),
        as a token offset: the tokens every conversation with this system prompt starts
        with. Found by rendering those messages before an empty user turn and keeping
        what ``tokens`` shares with it; ``()`` when that is nothing or the whole prompt."""
        n = next((i for i, m in enumerate(messages) if m.get("role") != "system"),
                 len(messages))
        try:
            head = self.tokenizer.apply_chat_template(
                [*messages[:n], {"role": "user", "content": ""}], tokenize=False,
                add_generation_prompt=False, **kwargs)
        except Exception:  # a template that refuses an empty turn: no checkpoint, no error
            return ()
        head_ids = self.tokenizer.encode(head, add_special_tokens=False)
        end = next((i for i, (a, b) in enumerate(zip(head_ids, tokens)) if a != b),
                   min(len(head_ids), len(tokens)))
        return (end,) if 0 < end < len(tokens) - 1 else ()

    def _cache_pins(self, request: GenerationRequest,
                    tokens: list[int]) -> tuple[tuple[int, float], ...]:
        """Each ``cache_marks`` entry as (prefix length in tokens, seconds): the tokens the
        prompt shares with its first messages rendered alone (the system prompt and tools
        before an empty user turn, for a mark on them)."""
        pins: dict[int, float] = {}
        for mark in request.cache_marks:
            head = list((request.messages or [])[:mark.messages])
            if not any(m.get("role") != "system" for m in head):
                head.append({"role": "user", "content": ""})
            part = replace(request, messages=head, add_generation_prompt=False,
                           continue_final_message=False)
            try:
                messages, kwargs, _ = self._template_input(part)
                text = self._apply_template(part, messages, kwargs)
            except InvalidRequest:  # a template that refuses the part: no pin, no error
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            end = next((i for i, (a, b) in enumerate(zip(ids, tokens)) if a != b),
                       min(len(ids), len(tokens)))
            if end > 0:
                pins[end] = max(pins.get(end, 0.0), mark.ttl_s)
        return tuple(sorted(pins.items()))

    def _checked_sampling(self, request: GenerationRequest) -> GenerationRequest:
        """400 for token ids outside the vocabulary; ``top_k`` >= vocabulary means off."""
        vocab = self.limits.vocab_size
        check_token_ids(request.sampling.logit_bias or {}, vocab, "logit_bias")
        check_token_ids(request.stop_token_ids, vocab, "stop_token_ids")
        if request.sampling.top_k >= vocab:
            return replace(request, sampling=replace(request.sampling, top_k=0))
        return request

    def _check_chars(self, n_chars: int, param: str) -> None:
        """Refuse text that cannot fit in the context without tokenising it."""
        ctx = self.limits.context_length
        bound = char_bound(ctx, self.limits.token_chars)
        if n_chars > bound:
            raise self._too_long(f"your prompt has {n_chars} characters, more than "
                                 f"{ctx} tokens can hold", param,
                                 tokens=n_chars * ctx // bound, counted=False)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenise ``text``, refusing oversized text before a full tokenisation."""
        self._check_chars(len(text), param)
        ctx = self.limits.context_length

        def encode(t: str) -> list[int]:
            return cast(list[int], self.tokenizer.encode(t, add_special_tokens=False))

        if len(text) > CHUNK_CHARS and reaches(encode, text, ctx):
            n = max(ctx, count_chunked(encode, text))
            raise self._too_long(f"your prompt has more than {ctx} tokens", param,
                                 tokens=n, counted=True)
        return cast(list[int], self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _too_long(self, detail: str, param: str, *, tokens: int,
                  counted: bool) -> ContextOverflow:
        return ContextOverflow(
            f"This model's maximum context length is {self.limits.context_length} tokens. "
            f"However, {detail}, leaving no room for the completion.",
            param=param, prompt_tokens=tokens, context=self.limits.context_length,
            counted=counted)

    def _check_limits(self, n_prompt: int, max_tokens: int | None) -> OutputLimit:
        """A prompt that alone fills the context is a 400; the output limit follows
        ``generation/output_length.py`` (the same rule for every API)."""
        ctx = self.limits.context_length
        if n_prompt >= ctx:
            raise self._too_long(f"your prompt has {n_prompt} tokens", "messages",
                                 tokens=n_prompt, counted=True)
        return output_limit(ctx, n_prompt, max_tokens)

    def _grammar(self, request: GenerationRequest, fmt: ToolCallFormat | None) -> str | None:
        """The llguidance grammar this request decodes under, validated (400 if bad)."""
        constraint = request.constraint
        forced = (request.messages is not None and bool(request.tools)
                  and request.tool_choice.mode in ("required", "function"))
        if forced and constraint is not None:
            # Worded for every API: OpenAI says "required", Anthropic "any".
            raise InvalidRequest("A forced tool call (tool_choice 'required' or 'any', or a "
                                 "named tool) cannot be combined with a structured output "
                                 "format.", param="tool_choice")
        if forced:
            assert fmt is not None
            constraint = tool_call_constraint(request.tools, request.tool_choice, fmt,
                                              self._lark_marker)
        if constraint is None:
            return None
        grammar = grammar_for(constraint)
        assert self.grammar_tokenizer is not None
        self.grammar_tokenizer.validate(
            grammar, "tool_choice" if forced else "response_format")
        return grammar

    def _lark_marker(self, marker: str) -> str:
        """A tool-call marker in Lark: by token id when it is one added token."""
        added = self.tokenizer.get_added_vocab()
        if marker in added:
            return f"<[{added[marker]}]>"
        return json.dumps(marker)
