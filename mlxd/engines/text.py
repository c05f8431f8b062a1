"""``MLXLanguageModel``: text generation over mlx-lm.

Loading, tokenizer and chat template, request preparation (tokenise, check
limits) and the async face of the scheduler that runs on the worker thread.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlxd.engines.device import weights_nbytes
from mlxd.engines.prefix_cache import PrefixCache, model_identity
from mlxd.engines.prompt_limits import (
    CHUNK_CHARS,
    char_bound,
    check_token_ids,
    max_token_chars,
    reaches,
    text_chars,
    vocab_bound,
)
from mlxd.engines.scheduler import (
    AsyncQueueSink,
    BatchScheduler,
    SchedulerBase,
    Sequence,
    SerialScheduler,
)
from mlxd.engines.structured import GrammarTokenizer
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.generation.chat import (
    template_messages,
    template_supports_tools,
    tools_system_prompt,
    with_tools_prompt,
)
from mlxd.generation.detokenizer import IncrementalDetokenizer
from mlxd.generation.events import Event, Finish
from mlxd.generation.params import GenerationRequest
from mlxd.generation.pipeline import OutputPipeline, PipelineOptions
from mlxd.generation.reasoning import ReasoningFormat, reasoning_format
from mlxd.generation.structured import forced_tool_format, grammar_for, tool_call_constraint
from mlxd.generation.tools import ToolCallFormat, tool_call_format
from mlxd.runtime.worker import ModelWorker

log = logging.getLogger(__name__)

# Requests tokenised at once per model: each is bounded by the context length, and
# together they must not take the memory of a flood of prompts.
PREPARE_CONCURRENCY = 4
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length",
                 "seq_length", "n_ctx", "max_seq_len", "model_max_length")


@dataclass
class TextEngineOptions:
    """Serving limits for one text model (from the server config and registry entry)."""

    max_num_seqs: int = 16
    max_queue: int = 256
    prefill_step_size: int = 2048
    prefix_cache_bytes: int = 256 * 1024 * 1024
    batching: bool = True
    max_context: int | None = None
    default_max_tokens: int = 512
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    prefix_cache_dir: Path | None = None


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


def context_length_of(config: dict[str, Any], tokenizer: Any = None) -> int:
    text_cfg = config.get("text_config") or {}
    for source in (config, text_cfg):
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    return 4096


class MLXLanguageModel:
    """A text LLM loaded with mlx-lm and served through a scheduler."""

    kind = "text"

    def __init__(self, name: str, path: Path, worker: ModelWorker,
                 options: TextEngineOptions | None = None) -> None:
        self.name = name
        self.path = Path(path)
        self.worker = worker
        self.options = options or TextEngineOptions()
        self.model: Any = None
        self.tokenizer: Any = None
        self.config: dict[str, Any] = {}
        self.context_length = 0
        self.scheduler: SchedulerBase | None = None
        self.prefix_cache: PrefixCache | None = None
        self.reasoning: ReasoningFormat | None = None
        self.tool_format: ToolCallFormat | None = None
        self.grammar_tokenizer: GrammarTokenizer | None = None
        self._weights_bytes = 0
        self.vocab_size = 0  # token ids a client may send: [0, vocab_size)
        self._token_chars = 64  # longest token in characters (bounds chars per token)
        self._prepare_slots = asyncio.Semaphore(PREPARE_CONCURRENCY)

    # -- lifecycle (worker thread) -----------------------------------------
    def load(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load

        try:
            model, tokenizer, config = cast(tuple[Any, Any, dict[str, Any]], load(
                str(self.path), return_config=True,
                trust_remote_code=self.options.trust_remote_code))
        except Exception as e:
            raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self._weights_bytes = weights_nbytes(model)
        ctx = context_length_of(config, tokenizer._tokenizer)
        if self.options.max_context:
            ctx = min(ctx, self.options.max_context)
        self.context_length = ctx
        self.vocab_size = vocab_bound(model, config, len(tokenizer))
        self._token_chars = max_token_chars(tokenizer)
        self._build_parsers()
        vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
                    or len(tokenizer))
        self.grammar_tokenizer = GrammarTokenizer(tokenizer._tokenizer, vocab,
                                                  sorted(tokenizer.eos_token_ids))
        batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        if self.options.prefix_cache_bytes > 0:
            self.prefix_cache = PrefixCache(self.options.prefix_cache_bytes,
                                            identity=model_identity(self.path))
        if self.options.batching and batchable:
            self.scheduler = BatchScheduler(
                model, tokenizer, max_num_seqs=self.options.max_num_seqs,
                max_queue=self.options.max_queue,
                prefill_step_size=self.options.prefill_step_size,
                prefix_cache=self.prefix_cache, wake=self.worker.wake)
        else:
            self.prefix_cache = None  # serial mode does not track cache contents
            self.scheduler = SerialScheduler(
                model, tokenizer, max_queue=self.options.max_queue,
                prefill_step_size=self.options.prefill_step_size, wake=self.worker.wake)
        self.worker.set_stepper(self.scheduler)
        if self.prefix_cache is not None and self.options.prefix_cache_dir is not None:
            restored = self.prefix_cache.restore(self.options.prefix_cache_dir)
            if restored:
                log.info("model %s: restored %d prefix cache entries", self.name, restored)

    def _build_parsers(self) -> None:
        """Fresh tokenizer-derived parser choices for this load."""
        tok = self.tokenizer
        detected = (tok.think_start, tok.think_end) if tok.has_thinking else None
        self.reasoning = reasoning_format(self.options.reasoning_parser, detected)
        mlx_parser = tok.init_kwargs.get("tool_parser_type") if hasattr(tok, "init_kwargs") else None
        self.tool_format = tool_call_format(self.options.tool_call_parser,
                                            tok.chat_template, mlx_parser)

    def persist_state(self) -> int:
        """Save the prefix cache so a reload can restore it (unload hook)."""
        if self.prefix_cache is None or self.options.prefix_cache_dir is None:
            return 0
        if len(self.prefix_cache) == 0:
            return 0
        return self.prefix_cache.save(self.options.prefix_cache_dir)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.worker.set_stepper(None)
        self.scheduler = None
        self.prefix_cache = None
        self.model = None
        gc.collect()
        mx.clear_cache()

    # -- facts -------------------------------------------------------------
    def memory_bytes(self) -> int:
        total = self._weights_bytes
        if self.prefix_cache is not None:
            total += self.prefix_cache.nbytes
        sched = self.scheduler
        if isinstance(sched, BatchScheduler):
            try:
                total += sched._gen.prompt_cache_nbytes
            except Exception:
                pass
        return total

    def describe(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            "context_length": self.context_length,
            "batching": getattr(sched, "mode", None),
            "max_num_seqs": sched.max_num_seqs if sched else None,
            "reasoning_parser": self.reasoning.name if self.reasoning else None,
            "tool_call_parser": self.tool_format.name if self.tool_format else None,
            "prefix_cache_bytes": self.prefix_cache.nbytes if self.prefix_cache else 0,
        }

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.scheduler.stats()) if self.scheduler else {}
        if self.prefix_cache is not None:
            out.update(prefix_cache_hits=self.prefix_cache.hits,
                       prefix_cache_misses=self.prefix_cache.misses,
                       prefix_cache_bytes=self.prefix_cache.nbytes,
                       prefix_cache_entries=len(self.prefix_cache))
        return out

    # -- requests ------------------------------------------------------------
    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenise and check limits off the event loop (tokenizers are not MLX)."""
        async with self._prepare_slots:
            return await asyncio.to_thread(self._prepare, request)

    def _render_chat(self, request: GenerationRequest) -> tuple[str, ToolCallFormat | None]:
        tok = self.tokenizer
        messages = template_messages(request.messages or [])
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
        if tok.chat_template is None:
            raise InvalidRequest(
                f"Model '{self.name}' has no chat template; use /v1/completions instead.")
        try:
            text = tok.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message, **kwargs)
        except Exception as e:  # jinja errors: roles must alternate, missing fields...
            raise InvalidRequest(f"The chat template rejected the messages: {e}",
                                 param="messages") from e
        return text, fmt

    def _prepare(self, request: GenerationRequest) -> PreparedPrompt:
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        request = self._checked_sampling(request)
        fmt: ToolCallFormat | None = None
        if request.messages is not None:
            self._check_chars(text_chars(request.messages), "messages")  # before rendering
            text, fmt = self._render_chat(request)
            tokens = self._encode(text, False, "messages")
        elif isinstance(request.prompt, str):
            text = request.prompt
            tokens = self._encode(text, True, "prompt")
        else:
            tokens = list(request.prompt or [])
            if tokens:
                self._check_limits(len(tokens), None)
            check_token_ids(tokens, self.vocab_size, "prompt")
            text = tok.decode(tokens)
        if not tokens:
            raise InvalidRequest("The prompt is empty.", param="prompt")
        max_tokens = self._check_limits(len(tokens), request.max_tokens)
        stop_ids = set(tok.eos_token_ids) | set(request.stop_token_ids)
        start_in_reasoning = bool(self.reasoning and request.messages is not None
                                  and self.reasoning.starts_inside(text))
        return PreparedPrompt(request, tokens, text, max_tokens, stop_ids,
                              start_in_reasoning, fmt, self._grammar(request, fmt))

    def _checked_sampling(self, request: GenerationRequest) -> GenerationRequest:
        """400 for token ids outside the vocabulary; ``top_k`` >= vocabulary means off."""
        bias = request.sampling.logit_bias or {}
        check_token_ids(bias, self.vocab_size, "logit_bias")
        check_token_ids(request.stop_token_ids, self.vocab_size, "stop_token_ids")
        if request.sampling.top_k >= self.vocab_size:
            return replace(request, sampling=replace(request.sampling, top_k=0))
        return request

    def _check_chars(self, n_chars: int, param: str) -> None:
        """Refuse text that cannot fit in the context without tokenising it."""
        limit = char_bound(self.context_length, self._token_chars)
        if n_chars > limit:
            raise self._too_long(f"your prompt has {n_chars} characters, more than "
                                 f"{self.context_length} tokens can hold", param)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenise ``text``, refusing oversized text before a full tokenisation."""
        self._check_chars(len(text), param)
        ctx = self.context_length
        if len(text) > CHUNK_CHARS and reaches(
                lambda t: self.tokenizer.encode(t, add_special_tokens=False), text, ctx):
            raise self._too_long(f"your prompt has more than {ctx} tokens", param)
        return cast(list[int], self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _too_long(self, detail: str, param: str) -> InvalidRequest:
        return InvalidRequest(
            f"This model's maximum context length is {self.context_length} tokens. However, "
            f"{detail}, leaving no room for the completion.",
            param=param, code="context_length_exceeded")

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

    def _check_limits(self, n_prompt: int, max_tokens: int | None) -> int:
        ctx = self.context_length
        if n_prompt >= ctx:
            raise InvalidRequest(
                f"This model's maximum context length is {ctx} tokens. However, your prompt "
                f"has {n_prompt} tokens, leaving no room for the completion.",
                param="messages", code="context_length_exceeded")
        if max_tokens is None:
            return min(self.options.default_max_tokens, ctx - n_prompt)
        if n_prompt + max_tokens > ctx:
            raise InvalidRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for "
                "the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _pipeline(self, prepared: PreparedPrompt) -> OutputPipeline:
        req = prepared.request
        options = PipelineOptions(
            stop=list(req.stop), include_stop_str_in_output=req.include_stop_str_in_output,
            reasoning=self.reasoning if req.messages is not None else None,
            start_in_reasoning=prepared.start_in_reasoning,
            tool_format=prepared.tool_format, tools=list(req.tools),
            prompt_tokens=len(prepared.tokens))
        detok = IncrementalDetokenizer(self.tokenizer, prepared.tokens)
        return OutputPipeline(detok, options)

    async def generate(self, prepared: PreparedPrompt, seed_offset: int = 0) -> AsyncIterator[Event]:
        """Stream events for one prepared prompt; closing the iterator cancels it.

        ``seed_offset`` gives each of ``n`` choices its own seed.
        """
        if self.scheduler is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        req = prepared.request
        sampling = req.sampling
        if seed_offset and sampling.seed is not None:  # wraps within the 64-bit seed space
            sampling = replace(sampling, seed=(sampling.seed + seed_offset) % 2**64)
        sink = AsyncQueueSink(asyncio.get_running_loop())
        seq = Sequence(
            seq_id=prepared.id + uuid.uuid4().hex[:8], prompt_tokens=prepared.tokens,
            max_tokens=prepared.max_tokens, sampling=sampling,
            stop_token_ids=prepared.stop_token_ids, pipeline=self._pipeline(prepared),
            sink=sink, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
            processor_factory=self._constraint_factory(prepared.grammar))
        scheduler = self.scheduler
        scheduler.submit(seq)
        finished = False
        try:
            while not finished:
                for event in await sink.queue.get():
                    yield event
                    if isinstance(event, Finish):
                        finished = True
                        break
        finally:
            if not finished:
                scheduler.cancel(seq.seq_id)

    def _lark_marker(self, marker: str) -> str:
        """A tool-call marker in Lark: by token id when it is one added token."""
        added = self.tokenizer.get_added_vocab()
        if marker in added:
            return f"<[{added[marker]}]>"
        return json.dumps(marker)

    def _constraint_factory(self, grammar: str | None) -> Any:
        if grammar is None or self.grammar_tokenizer is None:
            return None
        gt = self.grammar_tokenizer
        return lambda: [gt.processor(grammar)]

    async def prompt_logprobs(self, tokens: list[int], top: int) -> list[Any]:
        """Log-probabilities of each prompt token given its prefix (``echo`` + ``logprobs``)."""
        return await self.worker.run(self._prompt_logprobs, tokens, top)

    def _prompt_logprobs(self, tokens: list[int], top: int) -> list[Any]:
        from mlxd.generation.events import TokenLogprob, TopLogprob

        logits = self.model(mx.array(tokens)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out: list[Any] = [None]
        for pos in range(1, len(tokens)):
            row = logprobs[pos - 1]
            tid = tokens[pos]
            text = self.tokenizer.decode([tid])
            tops = []
            if top > 0:
                idx = cast(list[int], mx.argsort(-row)[:top].tolist())
                for i in idx:
                    t = self.tokenizer.decode([i])
                    tops.append(TopLogprob(t, float(row[i].item()), list(t.encode())))
            out.append(TokenLogprob(tid, text, float(row[tid].item()), list(text.encode()), tops))
        return out
