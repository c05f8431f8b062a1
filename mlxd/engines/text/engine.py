"""``MLXLanguageModel``: text generation over mlx-lm.

Loading (weights, tokenizer, parsers, the input processor, the decoder and
scheduler, the prefix cache), the async face of the scheduler that runs on the
worker thread, and prompt logprobs. Prompt preparation (chat template, tools,
limits, grammar) is ``engines/text/input_processor.py``; decoding is
``engines/text/mlx_lm_decoder.py`` under ``engines/text/scheduler.py``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from mlxd.engines.base import Tokenized
from mlxd.engines.device import map_large_buffers, weights_nbytes
from mlxd.engines.kernels.prefill import (
    PrefillAttention,
    cpu_prefill_chunk,
    install_cpu_prefill_attention,
)
from mlxd.engines.kernels.quantized_attention import dequantized_attention_bytes
from mlxd.engines.text.draft import DraftModel, load_draft_model, plain_kv
from mlxd.engines.text.hybrid_cache import can_batch, is_trimmable, prefill_batch_size
from mlxd.engines.text.input_processor import InputLimits, InputProcessor, PreparedPrompt
from mlxd.engines.text.kv_admission import HeldBeside, KVLedger, cache_dtype_bytes, kv_ledger
from mlxd.engines.text.lora import AdapterSet, attach_adapters
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder, LMSerialDecoder
from mlxd.engines.text.prefix_cache import PrefixCache, model_identity
from mlxd.engines.text.prefix_disk import DiskTier
from mlxd.engines.text.prompt_limits import max_token_chars, vocab_bound
from mlxd.engines.text.quantized_cache import (
    KVQuantization,
    dequantized_head,
    quantize_layers,
    unsupported_layers,
)
from mlxd.engines.text.scheduler import (
    AsyncQueueSink,
    BatchScheduler,
    SchedulerBase,
    Sequence,
    SerialScheduler,
)
from mlxd.engines.text.speculative import Drafter, SpeculativeOptions
from mlxd.engines.text.structured import GrammarTokenizer
from mlxd.engines.text.tool_parsers import tool_call_format
from mlxd.engines.upstream import mlx_lm as lm_internals
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.generation.detokenizer import IncrementalDetokenizer
from mlxd.generation.events import Event, Finish, TokenLogprob, TopLogprob
from mlxd.generation.params import GenerationRequest
from mlxd.generation.pipeline import OutputPipeline, PipelineOptions
from mlxd.generation.reasoning import ReasoningFormat, reasoning_format
from mlxd.generation.tools import ToolCallFormat
from mlxd.models.adapters import AdapterError, read_adapter
from mlxd.models.engine import EngineFacts, EngineStats, PrefixCacheStats
from mlxd.models.memory import text_transient_bytes
from mlxd.runtime.distributed import GroupOptions
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
    kv_output_estimate: int = 1024  # output tokens expected of a request with no limit
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    prefix_cache_dir: Path | None = None
    prefix_cache_disk_bytes: int = 0  # the disk tier under the prefix cache (0: none)
    prefix_cache_disk_dir: Path | None = None
    group: GroupOptions | None = None  # set when the model is sharded over a group
    speculative: SpeculativeOptions | None = None  # drafting in the batched scheduler
    draft_model: Path | None = None  # its folder, for ``speculative.mode == "draft"``
    adapters: dict[str, Path] = field(default_factory=dict)  # LoRA adapters: name -> folder
    kv_bits: int | None = None  # attention KV quantized to this many bits (None: not)
    kv_group_size: int = 64  # values per scale and bias of quantized KV


__all__ = ["MLXLanguageModel", "PreparedPrompt", "TextEngineOptions", "context_length_of"]


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
    # On CPU, decode-sized float32 matmuls go to BLAS's sgemv (``cpu_gemv``).
    HOST_GEMV = True

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
        self.inputs: InputProcessor | None = None  # built at each load
        self._weights_bytes = 0
        self.draft: Any = None  # the draft model (``--draft-model``), loaded with this one
        self.adapters: AdapterSet | None = None  # LoRA adapters, attached at load
        self._prefill_attention: PrefillAttention | None = None  # undone at close
        self.vocab_size = 0  # token ids a client may send: [0, vocab_size)
        self._prepare_slots = asyncio.Semaphore(PREPARE_CONCURRENCY)
        self.kv: KVLedger | None = None  # admission by live KV, under a memory budget
        self._transient_bytes = 0  # what one step holds beyond the live KV, reserved
        self.kv_quantization: KVQuantization | None = None  # --kv-bits, checked at load
        self._dequantized_head = (0, 0)  # (KV heads, bytes per token) of quantized KV, at load

    # -- lifecycle (worker thread) -----------------------------------------
    def load(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        lm_internals.ADAPTER.require(self.name)
        map_large_buffers()  # freed KV buffers go back to the OS, not to glibc's heap
        try:
            model, tokenizer, config = self._load_model()
        except Exception as e:
            raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.adapters = self._attach_adapters(model)
        self._prefill_attention = install_cpu_prefill_attention(model, self.HOST_GEMV)
        self._weights_bytes = weights_nbytes(model)
        # The wrapper forwards attribute reads to the HF tokenizer (model_max_length).
        ctx = context_length_of(config, tokenizer)
        if self.options.max_context:
            ctx = min(ctx, self.options.max_context)
        self.context_length = ctx
        self.vocab_size = vocab_bound(model, config, len(tokenizer))
        self._build_parsers()
        self.inputs = self._input_processor(config)
        probe_cache = make_prompt_cache(model)
        self.kv_quantization = self._kv_quantization(model, probe_cache)
        # A recurrent state cannot be cut back to the system prompt a new conversation
        # shares with others: checkpoint it where the system messages end.
        self.inputs.checkpoint_system = (self.options.prefix_cache_bytes > 0
                                         and not is_trimmable(probe_cache))
        self.draft = self._load_draft(probe_cache)
        self.scheduler = self._scheduler(model, probe_cache)
        self._transient_bytes = self._transient(model, config)
        self.kv = kv_ledger(model, config, self.worker.budget, self._held_beside_kv,
                            self.options.kv_output_estimate, self.kv_quantization)
        if isinstance(self.scheduler, BatchScheduler):
            self.scheduler.kv = self.kv
        self.worker.set_stepper(self.scheduler)
        if self.prefix_cache is not None and self.options.prefix_cache_dir is not None:
            restored = self.prefix_cache.restore(self.options.prefix_cache_dir)
            if restored:
                log.info("model %s: restored %d prefix cache entries", self.name, restored)

    def _transient(self, model: Any, config: dict[str, Any]) -> int:
        """What one step of this model's scheduler holds beyond the live KV: a prefill chunk
        of every row prefilled together, a decode step's logits (``text_transient_bytes``),
        and over quantized KV on CPU one layer's dequantized part of the cache."""
        sched = self.scheduler
        prefill_rows = decode_rows = 1  # the serial scheduler: one sequence
        if isinstance(sched, BatchScheduler) and isinstance(sched.decoder, LMBatchDecoder):
            prefill_rows, decode_rows = sched.decoder.prefill_rows, sched.max_num_seqs
        transient = text_transient_bytes(
            config, cpu_prefill_chunk(self.options.prefill_step_size),
            prefill_rows=prefill_rows, decode_rows=decode_rows,
            dtype_bytes=cache_dtype_bytes(model))
        if self.kv_quantization is not None and self._prefill_attention is not None:
            heads, head_bytes = self._dequantized_head
            transient += dequantized_attention_bytes(max(prefill_rows, decode_rows), heads,
                                                     head_bytes, self.context_length)
        return transient

    def _held_beside_kv(self) -> HeldBeside:
        return HeldBeside(self._weights_bytes, self.options.prefix_cache_bytes,
                          self._transient_bytes)

    def _kv_quantization(self, model: Any, probe_cache: list[Any]) -> KVQuantization | None:
        """``--kv-bits`` for this model, checked: every attention layer keeps a plain KV
        cache (no sliding window) and attends through a quantized one (one token is run
        through the model to see it, head dimension against the group size included)."""
        from mlx_lm.models.cache import make_prompt_cache

        opts = self.options
        if opts.kv_bits is None:
            return None
        kv = KVQuantization(opts.kv_bits, opts.kv_group_size)
        flags = f"--kv-bits {kv.bits} --kv-group-size {kv.group_size}"
        others = unsupported_layers(probe_cache)
        if others:
            raise ModelLoadError(self.name, f"{flags}: quantized KV replaces plain KV caches "
                                            f"only; this model also keeps {', '.join(others)}")
        try:
            cache = quantize_layers(make_prompt_cache(model), kv)
            mx.eval(model(mx.array([[0]]), cache=cache))
        except Exception as e:
            raise ModelLoadError(self.name, f"{flags}: this model cannot attend over "
                                            f"quantized KV ({type(e).__name__}: {e})") from e
        self._dequantized_head = dequantized_head(cache)
        return kv

    def _load_model(self) -> tuple[Any, Any, dict[str, Any]]:
        """Weights, tokenizer and config (a sharded engine loads its shard instead)."""
        from mlx_lm.utils import load

        return cast(tuple[Any, Any, dict[str, Any]], load(
            str(self.path), return_config=True, trust_remote_code=self.options.trust_remote_code))

    def _attach_adapters(self, model: Any) -> AdapterSet:
        """The entry's LoRA adapters, checked against this model and attached (their
        factors count in this model's weights); an empty set without any, so that
        ``add_adapter`` can attach one while requests run."""
        if not self.options.adapters:
            return AdapterSet.empty()
        try:
            infos = {name: read_adapter(folder, self.path)
                     for name, folder in self.options.adapters.items()}
            return attach_adapters(model, infos)
        except Exception as e:
            raise ModelLoadError(self.name, f"adapter: {e}") from e

    def add_adapter(self, name: str, folder: Path) -> None:
        """Attach LoRA adapter ``name`` (worker thread, between steps: running requests
        keep their rows). Loading it twice from the same folder is a no-op (a load that
        began after the entry named it already attached it)."""
        adapters = self.adapters
        if adapters is None or self.model is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        if name in adapters.names:
            if self.options.adapters.get(name) == Path(folder):
                return
            raise InvalidRequest(f"Adapter '{name}' is already loaded on model '{self.name}'.")
        try:
            info = read_adapter(Path(folder), self.path)
            before = adapters.nbytes
            adapters.add(self.model, name, info)
        except AdapterError as e:
            raise InvalidRequest(f"Adapter '{name}': {e}", param="adapter_path") from None
        self._weights_bytes += adapters.nbytes - before
        self.options = replace(self.options, adapters={**self.options.adapters,
                                                       name: Path(folder)})

    def remove_adapter(self, name: str) -> None:
        """Detach LoRA adapter ``name`` (worker thread; no running request may use it)."""
        adapters = self.adapters
        if adapters is None or self.model is None or name not in adapters.names:
            return
        before = adapters.nbytes
        adapters.remove(self.model, name)
        self._weights_bytes += adapters.nbytes - before
        self.options = replace(self.options, adapters={
            n: f for n, f in self.options.adapters.items() if n != name})

    def _load_draft(self, probe_cache: list[Any]) -> Any:
        """The draft model when this model drafts with one and can speculate (batched plain
        KV caches); its weights count in this model's memory."""
        opts = self.options
        if opts.draft_model is None or opts.speculative is None or \
                opts.speculative.mode != "draft":
            return None
        if not (opts.batching and plain_kv(probe_cache)):
            log.warning("model %s: speculation needs batched plain KV caches; the draft "
                        "model is not loaded", self.name)
            return None
        try:
            draft = load_draft_model(opts.draft_model, self.tokenizer)
        except Exception as e:
            raise ModelLoadError(self.name, f"draft model {opts.draft_model}: "
                                            f"{type(e).__name__}: {e}") from e
        self._weights_bytes += weights_nbytes(draft)
        return draft

    def _drafter(self) -> Callable[[], Drafter] | None:
        """A fresh draft-model drafter per batch generator, or None (prompt lookup)."""
        draft = self.draft
        if draft is None:
            return None
        vocab = min(self.vocab_size, vocab_bound(draft, {}, self.vocab_size))
        return lambda: DraftModel(draft, vocab=vocab)

    def _input_processor(self, config: dict[str, Any]) -> InputProcessor:
        """This load's prompt preparation: its tokenizer, limits, parsers and grammar."""
        tok = self.tokenizer
        vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
                    or len(tok))
        grammar = GrammarTokenizer(tok.backend_tokenizer, vocab, sorted(tok.eos_token_ids))
        limits = InputLimits(self.context_length, self.vocab_size, max_token_chars(tok))
        return InputProcessor(self.name, tok, limits, reasoning=self.reasoning,
                              tool_format=self.tool_format, grammar_tokenizer=grammar)

    def _scheduler(self, model: Any, probe_cache: list[Any]) -> SchedulerBase:
        """A batched scheduler over mlx-lm's ``BatchGenerator`` when every cache layer can
        be merged into a batch (and batching is on), else a serial one."""
        # On CPU, prompts are prefilled in shorter chunks (engines/kernels/prefill.py).
        opts = replace(self.options,
                       prefill_step_size=cpu_prefill_chunk(self.options.prefill_step_size))
        if opts.prefix_cache_bytes > 0:
            kv = self.kv_quantization  # a quantized state never meets a full-precision one
            identity = model_identity(self.path) + (
                f":kv{kv.bits}g{kv.group_size}" if kv is not None else "")
            disk = (DiskTier(opts.prefix_cache_disk_dir, opts.prefix_cache_disk_bytes, identity)
                    if opts.prefix_cache_disk_bytes > 0 and opts.prefix_cache_disk_dir else None)
            self.prefix_cache = PrefixCache(opts.prefix_cache_bytes, identity=identity, disk=disk)
        rows = self.adapters.rows if self.adapters is not None else None
        if opts.batching and can_batch(probe_cache):
            prefill_batch = prefill_batch_size(str(self.config.get("model_type", "")),
                                               probe_cache, opts.max_num_seqs)
            decoder = LMBatchDecoder(model, eos_ids=list(self.tokenizer.eos_token_ids),
                                     max_num_seqs=opts.max_num_seqs,
                                     prefill_step_size=opts.prefill_step_size,
                                     prefill_batch_size=prefill_batch,
                                     speculative=opts.speculative, drafter=self._drafter(),
                                     adapter_rows=rows, kv_quantization=self.kv_quantization)
            return BatchScheduler(
                decoder, self.tokenizer, max_num_seqs=opts.max_num_seqs,
                max_queue=opts.max_queue, prefill_step_size=opts.prefill_step_size,
                prefix_cache=self.prefix_cache, wake=self.worker.wake,
                checkpoint_before_last=not is_trimmable(probe_cache), share_prefills=True)
        return SerialScheduler(
            LMSerialDecoder(model, prefill_step_size=opts.prefill_step_size, adapter_rows=rows,
                            kv_quantization=self.kv_quantization),
            self.tokenizer,
            max_queue=opts.max_queue, wake=self.worker.wake, prefix_cache=self.prefix_cache)

    def _build_parsers(self) -> None:
        """Fresh tokenizer-derived parser choices for this load."""
        tok = self.tokenizer
        detected = (tok.think_start, tok.think_end) if tok.has_thinking else None
        self.reasoning = reasoning_format(self.options.reasoning_parser, detected)
        self.tool_format = tool_call_format(self.options.tool_call_parser, tok)

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
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # its disk tier's queued writes
        self.worker.set_stepper(None)
        self.scheduler = None
        self.kv = None
        self.prefix_cache = None
        self.inputs = None
        self.model = None
        self.draft = None
        if self._prefill_attention is not None:
            self._prefill_attention.undo()
            self._prefill_attention = None
        gc.collect()
        mx.clear_cache()

    # -- facts -------------------------------------------------------------
    def memory_bytes(self) -> int:
        total = self._weights_bytes
        if self.prefix_cache is not None:
            total += self.prefix_cache.nbytes
        sched = self.scheduler
        if isinstance(sched, BatchScheduler):
            # the KV granted to running sequences is held for them, grown into or not, and
            # while any run, what a step holds beyond it
            live = max(sched.cache_nbytes(), self.kv.granted_bytes() if self.kv else 0)
            total += live + (self._transient_bytes if live else 0)
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
            "transient_reserve_bytes": self._transient_bytes,
            "kv_bits": self.kv_quantization.bits if self.kv_quantization else None,
            "kv_group_size": (self.kv_quantization.group_size if self.kv_quantization
                              else None),
            "draft_model": (str(self.options.draft_model)
                            if self.draft is not None and self.options.draft_model else None),
            # what --speculative resolved to for this model (auto: on a GPU or fast BLAS)
            "speculative": (sched.decoder.speculation if isinstance(sched, BatchScheduler)
                            and isinstance(sched.decoder, LMBatchDecoder) else "off"),
        }

    def facts(self) -> EngineFacts:
        return EngineFacts(context_length=self.context_length,
                           reasoning_parser=self.reasoning.name if self.reasoning else None,
                           card=self.describe())

    def stats(self) -> EngineStats:
        out = self.scheduler.stats() if self.scheduler else EngineStats()
        cache = self.prefix_cache
        if cache is None:
            return out
        disk = cache.disk
        return replace(out, prefix_cache=PrefixCacheStats(
            hits=cache.hits, misses=cache.misses, nbytes=cache.nbytes, entries=len(cache),
            disk_bytes=disk.nbytes if disk is not None else None,
            disk_reads=disk.reads if disk is not None else 0))

    # -- requests ------------------------------------------------------------
    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenise and check limits off the event loop (tokenizers are not MLX)."""
        async with self._prepare_slots:
            return await asyncio.to_thread(self._prepare, request)

    def _prepare(self, request: GenerationRequest) -> PreparedPrompt:
        inputs = self.inputs
        if inputs is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        prepared = inputs.prepare(request)
        if request.adapter is not None:
            adapters = self.adapters
            if adapters is None or request.adapter not in adapters.names:
                raise InvalidRequest(f"Adapter '{request.adapter}' is not loaded on model "
                                     f"'{self.name}'.", param="model")
            prepared.adapter_slot = adapters.slot(request.adapter)
            # an adapter's KV never serves the base model or another adapter
            prepared.cache_salt = json.dumps(
                ["adapter", request.adapter, str(self.options.adapters[request.adapter]),
                 prepared.cache_salt])
        return prepared

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
        scheduler, inputs = self.scheduler, self.inputs
        if scheduler is None or inputs is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        req = prepared.request
        sampling = req.sampling
        if seed_offset and sampling.seed is not None:  # wraps within the 64-bit seed space
            sampling = replace(sampling, seed=(sampling.seed + seed_offset) % 2**64)
        if self.kv is not None:
            self.kv.refuse_never_fitting(prepared)
        sink = AsyncQueueSink(asyncio.get_running_loop())
        seq = Sequence(
            seq_id=prepared.id + uuid.uuid4().hex[:8], prompt=prepared,
            max_tokens=prepared.max_tokens, sampling=sampling,
            stop_token_ids=prepared.stop_token_ids, pipeline=self._pipeline(prepared),
            sink=sink, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
            processor_factory=inputs.constraint_factory(prepared.grammar))
        scheduler.submit(seq)
        finished = False
        try:
            while not finished:
                for event in await sink.channel.receive():
                    yield event
                    if isinstance(event, Finish):
                        finished = True
                        break
        finally:
            if not finished:
                scheduler.cancel(seq.seq_id)

    # -- what routes may know of a prepared prompt (the TextGenerator protocol) --
    def count_tokens(self, prepared: PreparedPrompt) -> int:
        return len(prepared.tokens)

    def cached_tokens(self, prepared: PreparedPrompt) -> int:
        pc = self.prefix_cache
        if pc is None or len(prepared.tokens) < 2:
            return 0
        namespace = pc.namespace(prepared.media_hashes, prepared.cache_salt)
        return min(pc.peek(prepared.tokens, namespace), len(prepared.tokens) - 1)

    def prompt_text(self, prepared: PreparedPrompt) -> str:
        return prepared.prompt_text

    def detokenize(self, tokens: Iterable[int]) -> str:
        return cast(str, self.tokenizer.decode(list(tokens)))

    # -- the token endpoints (the TextGenerator protocol) ---------------------
    async def tokenize(self, request: GenerationRequest, *, add_special_tokens: bool,
                       token_strs: bool = False) -> Tokenized:
        """``request``'s prompt or messages as token ids (``InputProcessor.tokenize``)."""
        inputs = self._loaded_inputs()
        async with self._prepare_slots:
            tokens = await asyncio.to_thread(inputs.tokenize, request, add_special_tokens)
            strs = await asyncio.to_thread(inputs.token_strings, tokens) if token_strs else None
        return Tokenized(tokens, self.context_length, strs)

    async def decode(self, tokens: Iterable[int]) -> str:
        """Client token ids as text, each checked against the vocabulary first."""
        inputs = self._loaded_inputs()
        async with self._prepare_slots:
            return await asyncio.to_thread(inputs.decode, list(tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tokenizer
        hf = lm_internals.hf_tokenizer(tok)
        template = getattr(tok, "chat_template", None)

        def special(name: str) -> str | None:
            value = getattr(hf, name, None)
            return value if isinstance(value, str) else None

        return {"tokenizer_class": type(hf).__name__, "eos_token": special("eos_token"),
                "bos_token": special("bos_token"), "pad_token": special("pad_token"),
                "unk_token": special("unk_token"), "model_max_length": self.context_length,
                "vocab_size": self.vocab_size,
                "chat_template": template if isinstance(template, str) else None}

    def _loaded_inputs(self) -> InputProcessor:
        inputs = self.inputs
        if inputs is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        return inputs

    async def prompt_logprobs(self, prepared: PreparedPrompt, top: int) -> list[TokenLogprob]:
        """Log-probabilities of each prompt token given its prefix (``echo`` + ``logprobs``);
        the first token, with nothing before it, has none."""
        return await self.worker.run(self._prompt_logprobs, prepared.tokens, top)

    def _prompt_logprobs(self, tokens: list[int], top: int) -> list[TokenLogprob]:
        logits = self.model(mx.array(tokens)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        first = self.detokenize(tokens[:1])
        out = [TokenLogprob(tokens[0], first, None, list(first.encode()), [])]  # type: ignore[arg-type]
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


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import TextGenerator

    _implements: type[TextGenerator] = MLXLanguageModel
