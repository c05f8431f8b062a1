"""A ``Decoder`` (``engines/text/decoder.py``) over mlx-vlm's continuous ``BatchGenerator``.

Each request's input embeddings are computed alone when it is inserted (the
vision tower runs once per request, or not at all when the feature cache
holds its images), then the generator prefills and decodes the batch over the
language model with per-request embeddings.

mlx-vlm's generator samples the whole batch with one function and stops on
one set of end tokens, while the scheduler gives every request its own
sampler, logits processors and stop ids. So each request that needs more than
greedy decoding gets one row-local logits processor that runs its processors,
records the log-probabilities the scheduler reports, and then samples with
the request's own sampler, leaving only the chosen token possible; the
shared greedy pick then returns exactly that token. Request-specific stop
ids end the sequence here.

Prefix reuse (turn 2 about the same image) is mlx-vlm's own automatic prefix
cache (``mlx_vlm.apc``): the generator keeps the KV blocks of prefilled prompts
and resumes a prompt from the longest stored prefix. Its hash chain is salted
per request with ``namespace(prompt)`` (model identity, media hashes and cache
salt), so blocks are only shared between prompts with the same images; its
memory is bounded by ``prefix_cache_bytes`` and counted in ``cache_nbytes``. A row
leaving the generation batch stores its answer's blocks as well
(``engines/vision/turns.py``), so turn 2 resumes after turn 1's answer, not before it.

First tokens are returned as soon as the prompt's last prefill step has sampled
them. mlx-vlm's generation batch is pipelined: it returns a token only from the
step that already computes the next one, so a request's first token would wait
for a whole decode step (about a quarter of a fully cached turn's time on a CPU),
and a request that ends with its first token (a stop, or ``max_tokens: 1``) would
pay for a step whose token is thrown away. The generator hands each new row's
first token over when the row joins the generation batch (``first_tokens``); the
decoder returns it at once, takes a row that ended out before the next step, and
drops the batch's own copy of that token when the step returns it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from mlxd.engines.text.decoder import (
    CacheAndTokens,
    LogitsProcessor,
    PromptProgress,
    Sampler,
    TokenResponse,
)
from mlxd.engines.text.input_processor import PreparedPrompt
from mlxd.engines.text.sampling import greedy
from mlxd.engines.text.speculative import SpeculativeOptions
from mlxd.engines.upstream import mlx_vlm as vlm_internals
from mlxd.engines.vision.speculative import Speculation, SpeculativeVLMBatch, rewindable
from mlxd.engines.vision.turns import AnswerKeeper

log = logging.getLogger(__name__)

EmbedFn = Callable[[PreparedPrompt], dict[str, Any]]
NamespaceFn = Callable[[PreparedPrompt], int]
_NBYTES_TRIES = 3
# Tokens per prefix-cache block (mlx-vlm's default is 16). A turn resumes from the last
# whole block of the previous one, so up to a block less one of turn 1's answer is
# prefilled again on turn 2; smaller blocks waste less (bench/vision.py's turn 2).
PREFIX_BLOCK_TOKENS = 8
# The pool's block count is this over the block size (mlx-vlm's default: 2048 x 16);
# the byte bound (--prefix-cache-bytes) is what limits it in practice.
PREFIX_POOL_TOKENS = 32768


@dataclass
class Progress:
    uid: int
    end_of_prompt: bool = True
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache


@dataclass
class Token:
    uid: int
    token: int
    logprobs: Any
    finish_reason: str | None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] = field(default_factory=list)


@dataclass
class Stats:
    generation_steps: int = 0
    decode_time: float = 0.0
    prompt_tokens: int = 0
    prompt_time: float = 0.0


@dataclass
class _Row:
    """What the adapter keeps for one sequence in the generator."""

    stop: set[int]
    tokens: list[int]
    max_tokens: int
    logprobs: deque[Any] = field(default_factory=deque)
    wants_logprobs: bool = False
    first_sent: bool = False  # returned early: the batch's copy of it is dropped


class RowSampler:
    """One request's processors and sampler, as a row-local mlx-vlm logits processor."""

    def __init__(self, row: _Row, sampler: Sampler, processors: list[LogitsProcessor]) -> None:
        self.row, self.sampler, self.processors = row, sampler, processors

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        for p in self.processors:
            logits = p(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.row.logprobs.append(logprobs[0])
        if self.sampler is greedy:
            return logits
        choice = self.sampler(logprobs)
        # Only the chosen token stays possible: the batch's greedy pick returns it.
        hot = mx.arange(logits.shape[-1]) == choice.reshape(-1, 1)
        return mx.where(hot, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` positions: drafts a speculative verify step rejected
        (``engines/vision/speculative.py``); the processors follow their context."""
        for _ in range(min(n, len(self.row.logprobs))):
            self.row.logprobs.pop()


def _generator_class() -> type:
    """mlx-vlm's ``BatchGenerator``, reusing cached prefixes that hold images.

    mlx-vlm refuses a cached prefix with image tokens in it, because its default block
    hash does not tell two images apart (their placeholder tokens are the same). Every
    prompt here carries a salt with its media hashes (``_apc_semantic_hash``), so blocks
    are shared only between prompts with the same images, and such a prefix is reusable.
    """
    from mlx_vlm.generate import BatchGenerator

    class MediaKeyedGenerator(BatchGenerator):  # type: ignore[misc]
        answers: AnswerKeeper | None = None  # set per instance by the decoder
        speculation: Speculation | None = None  # prompt lookup (None: off), by the decoder
        first_tokens: list[tuple[int, int]]  # (uid, token) of rows that just joined

        def _apc_prefix_has_media_tokens(self, ids_list: list[int], prefix_len: int) -> bool:
            return False

        def _extend_generation_batch(self, gen_batch: Any) -> None:
            # ``generate`` has evaluated the new rows' first tokens; read them before
            # ``extend`` joins them to the running rows' pending tokens.
            firsts = vlm_internals.pending_tokens(gen_batch)
            if firsts is not None and len(gen_batch.uids):
                self.first_tokens.extend(zip(map(int, gen_batch.uids),
                                             map(int, firsts.tolist()), strict=True))
            super()._extend_generation_batch(gen_batch)
            if self.speculation is not None:  # the running batch verifies drafts
                SpeculativeVLMBatch.adopt(self._generation_batch, self.speculation)
            # Rows leaving the batch store their answer's KV too (engines/vision/turns.py).
            if self.answers is not None:
                self.answers.watch(self._generation_batch, self.apc_manager)

    return MediaKeyedGenerator


def _manager_class() -> type:
    """mlx-vlm's prefix-cache manager, counting its resident bytes without re-measuring.

    mlx-vlm 0.7.10 sums the bytes of every block's every layer array each time it
    checks its byte bound: several times per request (before each prefill, each store),
    10 ms with 1,500 stored blocks of a 16-layer model and growing with the pool (up to
    4,096 blocks here), so a long-running server paid more per request the fuller its
    cache got. A block's bytes change only when its storage handles are replaced
    (``set_kv``) or dropped (``release_components``), so each block's figure is kept
    with the handles it was measured on and re-measured only when they are different
    objects. ``tests/test_vision_prefix.py`` checks it equals mlx-vlm's own sum as
    blocks are stored, evicted and released.
    """
    from mlx_vlm.apc import APCManager
    from mlx_vlm.models.cache import cache_nbytes

    class CountingAPCManager(APCManager):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # id(block) -> (the handles measured, their bytes); blocks live in the pool
            # for the manager's lifetime, so their ids are stable.
            self._block_bytes: dict[int, tuple[tuple[Any, ...], int]] = {}
            super().__init__(*args, **kwargs)

        def _resident_bytes_locked(self) -> int:
            memo = self._block_bytes
            total = 0
            for block in self.pool:
                if not block.components:
                    continue
                handles = tuple(block.components.values())
                known = memo.get(id(block))
                if known is None or len(known[0]) != len(handles) or any(
                        a is not b for a, b in zip(known[0], handles)):
                    known = (handles, int(block.resident_bytes()))
                    memo[id(block)] = known
                total += known[1]
            return total + sum(cache_nbytes(entry.prompt_cache)
                               for entry in self._exact_cache.values())

    return CountingAPCManager


class VLMBatchDecoder:
    """Continuous batching over ``mlx_vlm.generate.BatchGenerator``."""

    def __init__(self, model: Any, processor: Any, embed: EmbedFn, *, eos_ids: list[int],
                 max_num_seqs: int, prefill_step_size: int,
                 namespace: NamespaceFn | None = None, prefix_cache_bytes: int = 0,
                 speculative: SpeculativeOptions | None = None, name: str = "") -> None:
        self.model = model
        self.processor = processor
        self._embed = embed
        self._eos = sorted(eos_ids)
        self._max_num_seqs = max_num_seqs
        self._prefill_step_size = prefill_step_size
        self._rows: dict[int, _Row] = {}
        self._stats = Stats()
        self._namespace = namespace if prefix_cache_bytes > 0 else None
        self._prefix_bytes = prefix_cache_bytes
        self._apc: Any = None
        # prompts admitted with the prefix cache on: resumed from it (hits) or not
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.answers = AnswerKeeper()
        options = _speculation_options(model, speculative, self._eos, name)
        self._spec = Speculation(options) if options is not None else None
        self._gen = self._new_generator()

    def _new_apc(self) -> Any:
        """mlx-vlm's prefix cache, bounded to ``prefix_cache_bytes`` (None when off)."""
        if self._namespace is None:
            return None
        # In-memory only (no disk tier); its byte bound is the limit we count.
        return _manager_class()(num_blocks=PREFIX_POOL_TOKENS // PREFIX_BLOCK_TOKENS,
                                block_size=PREFIX_BLOCK_TOKENS,
                                overrides={"memory_max_gb": self._prefix_bytes / (1 << 30)})

    def _new_generator(self) -> Any:
        self._rows.clear()
        self._apc = self._new_apc()
        self.answers.rows.clear()
        gen = _generator_class()(
            self.model.language_model, self.processor, max_tokens=1,
            stop_tokens=set(self._eos), completion_batch_size=self._max_num_seqs,
            prefill_batch_size=self._max_num_seqs, prefill_step_size=self._prefill_step_size,
            compute_logprobs=False, stream=mx.default_stream(mx.default_device()),
            apc_manager=self._apc)
        gen.answers = self.answers
        gen.first_tokens = []
        if self._spec is not None:
            self._spec.rows.clear()
        gen.speculation = self._spec
        return gen

    # -- speculative decoding (engines/vision/speculative.py) --------------------
    @property
    def speculation(self) -> str:
        """How this decoder drafts: ``prompt-lookup`` or ``off``."""
        return "prompt-lookup" if self._spec is not None else "off"

    def draft_counts(self, uids: list[int]) -> dict[int, tuple[int, int]]:
        """(accepted, rejected) draft tokens of sequences that left; forgotten once read."""
        spec = self._spec
        if spec is None:
            return {}
        for uid in uids:
            spec.forget(uid)
        return {u: (c.accepted, c.rejected) for u, c in spec.pop_counts(uids).items()}

    def draft_totals(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens since the decoder started."""
        spec = self._spec
        return (spec.totals.accepted, spec.totals.rejected) if spec is not None else (0, 0)

    # -- the Decoder interface -------------------------------------------------
    def insert(self, prompt: PreparedPrompt, n_cached: int, cache: list[Any] | None,
               sampler: Sampler, processors: list[LogitsProcessor], stop: set[int],
               max_tokens: int) -> int:
        kwargs = self._embed(prompt)  # the whole prompt: the generator slices a cached prefix
        if self._namespace is not None:
            kwargs["_apc_semantic_hash"] = self._namespace(prompt)
        row = _Row(stop=set(stop), tokens=list(prompt.tokens), max_tokens=max_tokens,
                   wants_logprobs=(bool(processors) or sampler is not greedy
                                   or prompt.request.logprobs))
        proc = [RowSampler(row, sampler, processors)] if row.wants_logprobs else None
        (uid,) = self._gen.insert([list(prompt.tokens)], max_tokens=[max_tokens],
                                  prompt_kwargs=[kwargs], logits_processors=[proc])
        self._rows[int(uid)] = row
        if self._spec is not None:
            self._spec.track(int(uid), prompt.tokens)
        if self._namespace is not None:  # the row's tokens grow as it decodes
            self.answers.track(int(uid), row.tokens, int(kwargs["_apc_semantic_hash"]))
        return int(uid)

    def next(self) -> tuple[list[PromptProgress], list[TokenResponse]]:
        gen = self._gen
        # mlx-vlm admits waiting prompts only when ``prefill_batch_size`` slots are free:
        # a fixed size would hold newcomers back until the whole batch finished.
        free = gen.completion_batch_size - len(vlm_internals.generation_batch(gen))
        gen.prefill_batch_size = max(1, min(free, vlm_internals.waiting_prompts(gen)))
        t0 = time.perf_counter()
        prompt_before = vlm_internals.prompt_tokens_processed(gen)
        had_decoding = len(vlm_internals.generation_batch(gen)) > 0
        progress, responses = self._gen.next()
        elapsed = time.perf_counter() - t0
        if had_decoding and responses:
            self._stats.generation_steps += 1
            self._stats.decode_time += elapsed
        prompt_tokens = vlm_internals.prompt_tokens_processed(gen) - prompt_before
        if prompt_tokens:
            self._stats.prompt_tokens += prompt_tokens
            self._stats.prompt_time += elapsed
        reports = [Progress(int(p.uid), cached_tokens=int(getattr(p, "cached_tokens", 0) or 0))
                   for p in progress]
        if self._apc is not None:
            hits = sum(1 for p in reports if p.cached_tokens)
            self.prefix_hits += hits
            self.prefix_misses += len(reports) - hits
        done: list[PromptProgress] = list(reports)
        firsts, gen.first_tokens = gen.first_tokens, []
        return done, self._responses(responses) + self._first_responses(firsts)

    def _token(self, uid: int, row: _Row, token: int, reason: str | None) -> Token:
        """Record ``token`` on its row (with its logprobs) and forget a row that ended."""
        lp = row.logprobs.popleft() if row.logprobs else None
        row.tokens.append(token)
        if reason is not None:
            self._rows.pop(uid, None)
        return Token(uid, token, lp, reason, all_tokens=list(row.tokens))

    def _responses(self, responses: list[Any]) -> list[TokenResponse]:
        out: list[TokenResponse] = []
        ended: list[int] = []
        for r in responses:
            uid, token = int(r.uid), int(r.token)
            row = self._rows.get(uid)
            if row is None:
                continue
            if row.first_sent:  # the batch's copy of the first token, already returned
                row.first_sent = False
                continue
            reason = r.finish_reason
            if reason is None and token in row.stop:
                reason = "stop"
                ended.append(uid)
            out.append(self._token(uid, row, token, reason))
        for uid in ended:
            self._gen.remove(uid)
        return out

    def _first_responses(self, firsts: list[tuple[int, int]]) -> list[TokenResponse]:
        """The first token of each row that just joined the generation batch; a row that
        ends with it leaves the batch before the next step runs."""
        out: list[TokenResponse] = []
        for uid, token in firsts:
            row = self._rows.get(uid)
            if row is None:
                continue
            reason = ("stop" if token in row.stop or token in self._eos
                      else "length" if row.max_tokens <= 1 else None)
            out.append(self._token(uid, row, token, reason))
            if reason is None:
                row.first_sent = True
            else:
                self._gen.remove(uid)
        return out

    @contextmanager
    def stats(self) -> Iterator[Stats]:
        self._stats = Stats()
        yield self._stats

    def remove(self, uids: list[int], return_caches: bool = False) -> dict[int, CacheAndTokens]:
        for uid in uids:
            self._gen.remove(uid)
            self._rows.pop(uid, None)
            self.answers.forget(uid)  # removed before it decoded: nothing stored
            if self._spec is not None:
                self._spec.forget(uid)
        return {}

    def extract_cache(self, uids: list[int]) -> dict[int, CacheAndTokens]:
        return {}

    def set_prefill_chunk(self, tokens: int) -> None:
        self._gen.prefill_step_size = tokens

    def prefix_cache_nbytes(self) -> int:
        """Bytes mlx-vlm's prefix cache holds (0 when off); any thread."""
        for _ in range(_NBYTES_TRIES):
            try:
                return int(self._apc.resident_bytes()) if self._apc is not None else 0
            except (RuntimeError, IndexError, AttributeError, TypeError):
                continue  # the worker changed the pool meanwhile
        return 0

    def cache_nbytes(self) -> int:
        for _ in range(_NBYTES_TRIES):
            try:
                caches = list(vlm_internals.generation_batch(self._gen).prompt_cache or [])
                apc = self._apc.resident_bytes() if self._apc is not None else 0
                return apc + sum(int(getattr(c, "nbytes", 0)) for c in caches)
            except (RuntimeError, IndexError, AttributeError, TypeError):
                continue  # the worker changed the batch meanwhile
        return 0

    def reset(self) -> None:
        self._gen.close()
        self._gen = self._new_generator()

    def close(self) -> None:
        self._gen.close()
        self._rows.clear()


def _speculation_options(model: Any, options: SpeculativeOptions | None, eos: list[int],
                         name: str) -> SpeculativeOptions | None:
    """The options this model speculates with (end-of-sequence tokens never drafted), or
    None: speculation off, not enabled on this device (``SpeculativeOptions.enabled``),
    or not possible for the model (said once, at load)."""
    if options is None or not options.enabled:
        return None
    if options.mode == "draft":
        log.warning("model %s: vision models do not draft with a draft model; decoding "
                    "without speculation", name)
        return None
    why = rewindable(model.language_model)
    if why is not None:
        log.warning("model %s: no prompt-lookup speculation, as %s; decoding without it",
                    name, why)
        return None
    return replace(options, stop_ids=frozenset(eos))
