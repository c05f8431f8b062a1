"""Decoders over mlx-lm (``engines/text/decoder.py``'s interfaces for token prompts).

``LMBatchDecoder`` wraps ``mlx_lm.generate.BatchGenerator``; ``LMSerialDecoder``
wraps ``generate_step``. Media items are never set on a text model's prompts
(its input processor refuses media parts), so both read tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlxd.engines.text.decoder import (
    CacheAndTokens,
    LogitsProcessor,
    PromptProgress,
    Sampler,
    StepStats,
    TokenResponse,
)
from mlxd.engines.text.hybrid_cache import SerialRun, prefill, segments, snapshot, with_context
from mlxd.engines.text.input_processor import PreparedPrompt
from mlxd.engines.text.lora import AdapterRows, route_rows
from mlxd.engines.text.quantized_cache import KVQuantization, quantize_layers
from mlxd.engines.text.recurrent_rewind import RecurrentReplay
from mlxd.engines.text.speculative import (
    Drafter,
    SpeculativeBatch,
    SpeculativeOptions,
    install,
    pop_counts,
)
from mlxd.engines.upstream import mlx_lm as lm_internals

# Reading the batch's cache size from another thread can meet the worker
# mid-update (a deque or list resized while summed); a few retries find a
# quiet moment.
_NBYTES_TRIES = 3


class LMBatchDecoder:
    """Continuous batching over mlx-lm's ``BatchGenerator``."""

    def __init__(self, model: Any, *, eos_ids: list[int], max_num_seqs: int,
                 prefill_step_size: int, prefill_batch_size: int | None = None,
                 speculative: SpeculativeOptions | None = None,
                 drafter: Callable[[], Drafter] | None = None,
                 adapter_rows: AdapterRows | None = None,
                 kv_quantization: KVQuantization | None = None) -> None:
        self.model = model
        self._rows = adapter_rows  # each sequence's LoRA adapter (None: no adapters loaded)
        self._kv = kv_quantization  # attention layers' KV quantized (None: full precision)
        self._speculative = speculative
        self._new_drafter = drafter  # a draft model's drafter per generator (None: lookup)
        self._spec: SpeculativeBatch | None = None
        self._eos = sorted(eos_ids)
        self._max_num_seqs = max_num_seqs
        self._prefill_step_size = prefill_step_size
        # prompts prefilled together (1 for hybrids whose recurrent layers ignore padding)
        self._prefill_batch_size = prefill_batch_size or max_num_seqs
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.model,
            max_tokens=1,
            stop_tokens=[[t] for t in self._eos],
            completion_batch_size=self._max_num_seqs,
            prefill_batch_size=self._prefill_batch_size,
            prefill_step_size=self._prefill_step_size,
            stream=mx.default_stream(mx.default_device()),
        )
        spec = self._speculative
        # a draft mode without a draft model (not loaded for this model) does not speculate,
        # nor a model whose caches cannot be rewound after a rejected draft (a draft model's
        # own cache rewinds like a KV cache: it needs a target without recurrent layers)
        replay = RecurrentReplay.find(self.model, make_prompt_cache(self.model))
        rewinds = replay is not None and not (self._new_drafter and replay.modules)
        if spec is not None and spec.enabled and rewinds and \
                (spec.mode != "draft" or self._new_drafter):
            # the model's end-of-sequence tokens are never drafted
            drafter = self._new_drafter() if self._new_drafter is not None else None
            self._spec = install(gen, replace(spec, stop_ids=frozenset(self._eos)), drafter)
        else:  # the same batch class, never drafting: it skips the forward no row reads
            install(gen, SpeculativeOptions(mode="off"))
        if self._rows is not None:
            route_rows(gen, self._rows)
        lm_internals.settle_joins(gen)  # rows joining the batch: copies a layer at a time
        return gen

    @property
    def prefill_rows(self) -> int:
        """Prompts prefilled together, each a chunk per step."""
        return min(self._prefill_batch_size, self._max_num_seqs)

    @property
    def speculation(self) -> str:
        """How this decoder drafts: ``draft`` (a draft model), ``prompt-lookup`` or ``off``
        (also for a model whose caches cannot be rewound after a rejected draft)."""
        if self._spec is None:
            return "off"
        return "draft" if self._new_drafter is not None else "prompt-lookup"

    def draft_counts(self, uids: list[int]) -> dict[int, tuple[int, int]]:
        """(accepted, rejected) draft tokens of sequences that left; forgotten once read."""
        return {u: (c.accepted, c.rejected) for u, c in pop_counts(self._spec, uids).items()}

    def draft_totals(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens since the decoder started."""
        spec = self._spec
        return (spec.totals.accepted, spec.totals.rejected) if spec is not None else (0, 0)

    def next(self) -> tuple[list[PromptProgress], list[TokenResponse]]:
        prompts, tokens = self._gen.next()
        if self._rows is not None:
            self._rows.forget(r.uid for r in tokens if r.finish_reason is not None)
        return cast(tuple[list[PromptProgress], list[TokenResponse]], (prompts, tokens))

    def stats(self) -> AbstractContextManager[StepStats]:
        return cast(AbstractContextManager[StepStats], self._gen.stats())

    def insert(self, prompt: PreparedPrompt, n_cached: int, cache: list[Any] | None,
               sampler: Sampler, processors: list[LogitsProcessor], stop: set[int],
               max_tokens: int) -> int:
        tokens = prompt.tokens
        if self._kv is not None:  # the row's attention layers join a quantized batch
            cache = quantize_layers(cache if cache is not None else
                                    make_prompt_cache(self.model), self._kv)
        # cut at the prompt's checkpoints (hybrids: where the system prompt ends) so the
        # generator stops there and the scheduler can store the state
        (uid,) = self._gen.insert_segments(
            [segments(tokens, n_cached, getattr(prompt, "checkpoints", ()))],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:n_cached]] if cache is not None else None,
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[StopSequences([[t] for t in sorted(stop)])],
        )
        if self._rows is not None:
            self._rows.assign(int(uid), prompt.adapter_slot)
        return int(uid)

    def remove(self, uids: list[int], return_caches: bool = False) -> dict[int, CacheAndTokens]:
        if self._rows is not None:
            self._rows.forget(uids)
        return self._gen.remove(uids, return_prompt_caches=return_caches)

    def extract_cache(self, uids: list[int]) -> dict[int, CacheAndTokens]:
        return self._gen.extract_cache(uids)

    def set_prefill_chunk(self, tokens: int) -> None:
        self._gen.prefill_step_size = tokens

    def cache_nbytes(self) -> int:
        for _ in range(_NBYTES_TRIES):
            try:
                return int(self._gen.prompt_cache_nbytes) + self._drafter_nbytes()
            except (RuntimeError, IndexError):  # the worker changed the batch meanwhile
                continue
        return 0

    def _drafter_nbytes(self) -> int:
        """The draft model's batched cache (a draft model's drafter has one)."""
        drafter = self._spec.drafter if self._spec is not None else None
        return int(getattr(drafter, "nbytes", 0))

    def reset(self) -> None:
        if self._rows is not None:
            self._rows.clear()
        self._gen = self._new_generator()  # the old one closes itself when collected

    def close(self) -> None:
        self._gen.close()


class LMSerialDecoder:
    """One sequence at a time through mlx-lm's ``generate_step`` (unbatchable caches).

    The prompt but its last token is prefilled here, so its state can be
    checkpointed for the prefix cache before decoding starts.
    """

    def __init__(self, model: Any, *, prefill_step_size: int,
                 adapter_rows: AdapterRows | None = None,
                 kv_quantization: KVQuantization | None = None) -> None:
        self.model = model
        self.prefill_step_size = prefill_step_size
        self._rows = adapter_rows  # the running sequence's LoRA adapter
        self._kv = kv_quantization  # attention layers' KV quantized (None: full precision)
        self._run: SerialRun | None = None

    def start(self, prompt: PreparedPrompt, sampler: Sampler,
              processors: list[LogitsProcessor], max_tokens: int,
              cache: list[Any] | None = None, n_cached: int = 0,
              checkpoint_prompt: bool = False) -> Iterator[tuple[Any, mx.array]]:
        tokens = prompt.tokens
        if self._rows is not None:  # one sequence at a time: its slot holds until the next
            self._rows.set_slots([prompt.adapter_slot])
        cache = cache if cache is not None else make_prompt_cache(self.model)
        if self._kv is not None:
            cache = quantize_layers(cache, self._kv, QuantizedKVCache)
        states: list[CacheAndTokens] = []
        done = n_cached
        # up to each checkpoint (hybrids: where the system prompt ends), then all but the
        # last token; the last piece of ``segments`` holds the last token
        for piece in segments(tokens, n_cached, getattr(prompt, "checkpoints", ()))[:-1]:
            prefill(self.model, cache, piece, self.prefill_step_size)
            done += len(piece)
            if checkpoint_prompt:
                states.append((snapshot(cache), tokens[:done]))
        prefill(self.model, cache, tokens[done:-1], self.prefill_step_size)
        head = tokens[:-1]
        if checkpoint_prompt and head:
            states.append((snapshot(cache), head))
        self._run = run = SerialRun(cache, tokens, states)
        steps = generate_step(
            mx.array(tokens[-1:]), self.model, max_tokens=max_tokens, sampler=sampler,
            logits_processors=[with_context(p, head) for p in processors],
            prompt_cache=cache, prefill_step_size=self.prefill_step_size)
        return run.track(steps)

    def prompt_state(self) -> CacheAndTokens | None:
        """The running prompt's next checkpoint (``checkpoint_prompt``), each taken once;
        None when all were taken."""
        run = self._run
        if run is None or not run.prompt_states:
            return None
        return run.prompt_states.pop(0)

    def final_state(self) -> CacheAndTokens | None:
        """The ended generation's cache and the tokens it covers."""
        run, self._run = self._run, None
        return run.final_state() if run else None
