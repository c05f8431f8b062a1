"""Schedulers that drive text generation on a model's worker thread.

``BatchScheduler`` does continuous batching over a ``Decoder``
(``engines/text/decoder.py``; mlx-lm's ``BatchGenerator`` for text models):
requests join between decode steps, leave when finished, stopped or
cancelled, and long prompts are prefilled in chunks interleaved with decode.
``SerialScheduler`` runs one sequence at a time through a ``SerialDecoder``
for models whose caches cannot be batched (or with ``--no-batching``).
Neither knows which library decodes: a sequence carries its prepared prompt
(tokens, media, cache salt) and the decoder reads what it needs from it.

The prefix cache is keyed by the prompt's tokens within a namespace of the
model's identity, the prompt's media hashes and its cache salt, computed once
when a sequence is admitted; the per-step path does no extra work.

Entry points called from the event loop (``submit``, ``cancel``) only touch
lock-protected queues; everything else runs on the worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx

from mlxd.engines.device import release_free_memory
from mlxd.engines.text.decoder import Decoder, DraftCounting, SerialDecoder
from mlxd.engines.text.input_processor import PreparedPrompt
from mlxd.engines.text.kv_admission import KVLedger
from mlxd.engines.text.prefix_cache import PrefixCache
from mlxd.engines.text.sampling import (
    Sampler,
    build_logits_processors,
    build_sampler,
    greedy,
    heal_random_state,
    tag_sampling,
)
from mlxd.engines.text.shared_prefix import track_prefill, waits_for_peer
from mlxd.errors import Overloaded
from mlxd.generation.events import Event, TokenLogprob, TopLogprob
from mlxd.generation.params import SamplingParams
from mlxd.generation.pipeline import OutputPipeline
from mlxd.models.engine import EngineStats, SchedulerStats
from mlxd.runtime.channel import LoopChannel, send_all

log = logging.getLogger(__name__)

# Prompts at least this long have their KV state cached as soon as prefill
# ends, so concurrent requests sharing the prefix reuse it in flight.
IN_FLIGHT_CACHE_MIN_TOKENS = 64
# While streams are decoding, a prefill chunk may take about this many decode
# steps' worth of time, so one long prompt cannot stall the others.
PREFILL_INTERLEAVE = 1.5
MIN_PREFILL_CHUNK = 32


class EventSink:
    """Where a sequence's events go."""

    def push(self, events: list[Event]) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class AsyncQueueSink(EventSink):
    """Events for a consumer on an asyncio event loop (the HTTP side)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.channel: LoopChannel[list[Event]] = LoopChannel(loop)

    def push(self, events: list[Event]) -> None:
        self.channel.send(events)


def deliver(batch: list[tuple[EventSink, list[Event]]]) -> None:
    """Hand events to their sinks: one thread hop per event loop per step, however
    many sequences the step advanced (``runtime/channel.py``'s ``send_all``)."""
    to_loops: list[tuple[LoopChannel[Any], list[Event]]] = []
    for sink, events in batch:
        if isinstance(sink, AsyncQueueSink):
            to_loops.append((sink.channel, events))
        else:
            sink.push(events)
    send_all(to_loops)


@dataclass
class Sequence:
    """One generation in a scheduler."""

    seq_id: str
    prompt: PreparedPrompt  # tokens, media and cache salt
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: set[int]
    pipeline: OutputPipeline
    sink: EventSink
    logprobs: bool = False
    top_logprobs: int = 0
    extra_processors: list[Callable[[mx.array, mx.array], mx.array]] = field(default_factory=list)
    processor_factory: Callable[[], list[Any]] | None = None
    uid: int = -1
    error: str | None = None
    cache_key: str | None = None  # prefix-cache namespace, set on admission
    n_cached: int = 0  # prompt tokens resumed from the prefix cache, set on admission
    prefilled: int = 0  # prompt tokens in its cache so far (shared_prefix.py)
    submitted_at: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)  # its output token ids so far
    resumed_from: int = 0  # output tokens folded into ``prompt`` by a preemption

    @property
    def kv_tokens(self) -> int:
        """Tokens its KV state holds once prefilled: its prompt and output so far."""
        return len(self.prompt.tokens) - self.resumed_from + len(self.generated)

    @property
    def resumable(self) -> bool:
        """Whether a preemption can resume it exactly: no logits processor keeps state
        (a grammar) across its tokens."""
        return self.processor_factory is None and not self.extra_processors

    @property
    def prompt_tokens(self) -> list[int]:
        return self.prompt.tokens

    def admitted(self) -> None:
        """It leaves the queue for the running batch: record how long it waited."""
        self.pipeline.queue_seconds = time.monotonic() - self.submitted_at


class SchedulerBase:
    """Queueing, cancellation and event delivery shared by both schedulers."""

    def __init__(self, tokenizer: Any, *, max_num_seqs: int, max_queue: int,
                 prefix_cache: PrefixCache | None, wake: Callable[[], None]) -> None:
        self.tokenizer = tokenizer
        self.max_num_seqs = max(1, max_num_seqs)
        self.max_queue = max(0, max_queue)
        self.prefix_cache = prefix_cache
        self._wake = wake
        self._lock = threading.Lock()
        self._waiting: deque[Sequence] = deque()
        self._cancelled: set[str] = set()
        self.running: dict[int, Sequence] = {}
        self.steps = 0
        # steps run with each batch size (index = sequences in the batch), for /metrics
        self.batch_sizes = [0] * (self.max_num_seqs + 1)
        self.closed = False
        self._outbox: list[tuple[EventSink, list[Event]]] = []
        # prefix-cache inserts of this step, run once its events are delivered
        self._inserts: list[tuple[list[int], list[Any], str | None]] = []

    # -- called from the event loop ---------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; 503 when the running batch and the queue are full."""
        with self._lock:
            if self.closed:
                raise Overloaded("The model is unloading; retry shortly.", retry_after=1)
            free_slots = self.max_num_seqs - len(self.running)
            if len(self._waiting) >= self.max_queue + max(0, free_slots):
                raise Overloaded(
                    f"Request queue is full ({len(self.running)} running, "
                    f"{len(self._waiting)} waiting, --max-queue {self.max_queue}).",
                    retry_after=2, code="queue_full")
            self._waiting.append(seq)
        self._wake()

    def cancel(self, seq_id: str) -> None:
        """Stop a sequence at the next step (client disconnected or gave up)."""
        with self._lock:
            self._cancelled.add(seq_id)
        self._wake()

    def stats(self) -> EngineStats:
        with self._lock:
            running, waiting = len(self.running), len(self._waiting)
            counted = SchedulerStats(steps=self.steps, batch_sizes=tuple(self.batch_sizes))
        return EngineStats(running=running, waiting=waiting,
                           scheduler=self._more_stats(counted))

    def _more_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """What a scheduler adds to its counters (drafts, KV admission)."""
        return stats

    # -- worker thread ----------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self._waiting or self._cancelled)

    def _take(self, capacity: int) -> tuple[list[Sequence], set[str]]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            admitted: list[Sequence] = []
            while self._waiting and len(admitted) < capacity:
                seq = self._waiting.popleft()
                if seq.seq_id in cancelled:
                    cancelled.discard(seq.seq_id)
                    self._finish_unstarted(seq)
                    continue
                admitted.append(seq)
            for seq in [s for s in self._waiting if s.seq_id in cancelled]:
                self._waiting.remove(seq)
                cancelled.discard(seq.seq_id)
                self._finish_unstarted(seq)
            return admitted, cancelled

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Put taken sequences back at the head of the queue, in order."""
        if seqs:
            with self._lock:
                self._waiting.extendleft(reversed(seqs))

    def _finish_unstarted(self, seq: Sequence) -> None:
        self._emit(seq, seq.pipeline.finish("cancelled"))

    def _emit(self, seq: Sequence, events: list[Event]) -> None:
        if events:
            self._outbox.append((seq.sink, events))

    def _flush(self) -> None:
        """Deliver what this step produced (called at the end of every step)."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            deliver(outbox)

    def step(self) -> None:
        """Advance every running sequence by one token (worker thread)."""
        try:
            self._step()
        finally:
            self._flush()
            self._insert_cached()

    def _cache(self, tokens: list[int], cache: list[Any], key: str | None) -> None:
        """Store a state in the prefix cache after this step's events are delivered: the
        insert evaluates a copy of the state (tens of ms for a few thousand tokens),
        which a client waiting for its first token or its answer's end need not wait
        for. The worker runs it before its next step, so no admission misses it."""
        if self.prefix_cache is not None:
            self._inserts.append((tokens, cache, key))

    def _insert_cached(self) -> None:
        inserts = self._inserts
        if not inserts:
            return
        try:
            while inserts:
                assert self.prefix_cache is not None
                tokens, cache, key = inserts[0]
                self.prefix_cache.insert(tokens, cache, key)
                # let go of it once stored: an entry the next insert evicts must be freed
                # before that insert's copy is made
                del cache
                inserts.pop(0)
            if not self.running:
                # the entries were slices of the batch's buffer, which is free only now
                release_free_memory()
        finally:
            self._inserts = []  # only now: ``settled`` reads it from other threads

    def settled(self) -> bool:
        """Whether nothing runs, waits or is left to store (any thread)."""
        return not (self.has_work() or self._inserts)

    def _step(self) -> None:  # pragma: no cover - implemented by subclasses
        raise NotImplementedError

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._emit(seq, seq.pipeline.finish(reason, error))

    def _logprob(self, seq: Sequence, token: int, logprobs: mx.array) -> TokenLogprob | None:
        if not seq.logprobs:
            return None
        top: list[TopLogprob] = []
        if seq.top_logprobs > 0:
            k = min(seq.top_logprobs, logprobs.shape[-1])
            idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
            vals = logprobs[idx]
            order = mx.argsort(-vals)
            ids = cast(list[int], idx[order].tolist())
            values = cast(list[float], vals[order].tolist())
            for i, v in zip(ids, values):
                text = self.tokenizer.decode([i])
                top.append(TopLogprob(text, float(v), list(text.encode("utf-8"))))
        text = self.tokenizer.decode([token])
        return TokenLogprob(token, text, float(cast(float, logprobs[token].item())),
                            list(text.encode("utf-8")), top)

    def _guarded_processors(self, seq: Sequence) -> list[Any]:
        """Per-request logits processors; an exception fails only this sequence."""
        processors = build_logits_processors(seq.sampling) + list(seq.extra_processors)
        if seq.processor_factory is not None:
            processors += seq.processor_factory()
        if not processors:
            return []

        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            if seq.error is not None:
                return logits
            try:
                for p in processors:
                    logits = p(tokens, logits)
                return logits
            except Exception as e:
                log.warning("request %s: logits processor failed: %s", seq.seq_id, e)
                seq.error = f"logits processor failed: {e}"
                return logits

        return [guarded]

    def _guarded_sampler(self, seq: Sequence) -> Sampler:
        """This request's sampler; an exception fails only this sequence.

        The failed call answers with the greedy token so the batch it shares
        stays consistent; the scheduler drops the sequence after the step and
        never emits that token. A failure inside a compiled sampling function
        can leave MLX's global PRNG unusable, which would break every later
        sampled request, so it is repaired here. Greedy requests keep the one
        shared function so a batch of them still samples in a single call.
        """
        sampler = build_sampler(seq.sampling)
        if sampler is greedy:
            return greedy

        def guarded(logprobs: mx.array) -> mx.array:
            if seq.error is not None:
                return greedy(logprobs)
            try:
                return sampler(logprobs)
            except Exception as e:
                heal_random_state()
                log.warning("request %s: sampler failed: %s", seq.seq_id, e)
                seq.error = f"sampling failed: {e}"
                return greedy(logprobs)

        return tag_sampling(guarded, seq.sampling)

    def _fail_setup(self, seq: Sequence, error: Exception) -> None:
        """A sequence could not be started: end it alone with an error event."""
        log.exception("request %s: could not start generation", seq.seq_id)
        heal_random_state()
        self._finish(seq, "error", f"generation failed: {type(error).__name__}: {error}")

    def fail_all(self, error: BaseException) -> None:
        """A step failed for the whole batch: end every sequence with an error."""
        message = f"generation failed: {error}"
        heal_random_state()  # shared state must not outlive the failure
        for seq in list(self.running.values()):
            self._finish(seq, "error", message)
        self.running.clear()
        admitted, _ = self._take(1 << 30)
        for seq in admitted:
            self._finish(seq, "error", message)
        self._reset_after_failure()
        self._flush()

    def _reset_after_failure(self) -> None:
        pass

    def close(self) -> None:
        """End everything (model unloading); called on the worker thread."""
        with self._lock:
            self.closed = True
        for seq in list(self.running.values()):
            self._finish(seq, "cancelled", "model unloaded")
        self.running.clear()
        admitted, _ = self._take(1 << 30)
        for seq in admitted:
            self._finish(seq, "cancelled", "model unloaded")
        self._flush()


class BatchScheduler(SchedulerBase):
    """Continuous batching over a ``Decoder``."""

    mode = "batched"

    def __init__(self, decoder: Decoder, tokenizer: Any, *, max_num_seqs: int, max_queue: int,
                 prefill_step_size: int, prefix_cache: PrefixCache | None,
                 wake: Callable[[], None], checkpoint_before_last: bool = False,
                 share_prefills: bool = False) -> None:
        super().__init__(tokenizer, max_num_seqs=max_num_seqs, max_queue=max_queue,
                         prefix_cache=prefix_cache, wake=wake)
        self.decoder = decoder
        # a prompt waits for a running prefill of the prefix it shares (shared_prefix.py)
        self.share_prefills = share_prefills
        self.prefill_step_size = prefill_step_size
        # Untrimmable (recurrent) states are checkpointed before the prompt's last token:
        # it often re-tokenizes with the answer that follows it in the next turn's prompt.
        self.checkpoint_before_last = checkpoint_before_last
        self._decode_step_s: float | None = None  # moving average per decode step
        self._prefill_tps: float | None = None  # moving average prompt tokens/s
        # admission by live KV (kv_admission.py), set by the engine when a budget applies
        self.kv: KVLedger | None = None

    def _reset_after_failure(self) -> None:
        self.decoder.reset()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if isinstance(self.decoder, DraftCounting):  # speculative decoding: usage counts
            counts = self.decoder.draft_counts([seq.uid]).get(seq.uid)
            if counts is not None:
                seq.pipeline.accepted_prediction_tokens, seq.pipeline.rejected_prediction_tokens \
                    = counts
        if self.kv is not None:
            self.kv.release(seq.seq_id)
        super()._finish(seq, reason, error)

    def _more_stats(self, stats: SchedulerStats) -> SchedulerStats:
        draft = self.decoder.draft_totals() if isinstance(self.decoder, DraftCounting) else None
        return replace(stats, draft=draft, kv=self.kv.stats() if self.kv else None)

    def cache_nbytes(self) -> int:
        """Bytes the running batch's KV states hold (any thread)."""
        return self.decoder.cache_nbytes()

    def _step(self) -> None:
        admitted, cancelled = self._take(self.max_num_seqs - len(self.running))
        if cancelled:
            self._remove([s for s in self.running.values() if s.seq_id in cancelled], "cancelled")
        held = []
        for i, seq in enumerate(admitted):
            if self.share_prefills and waits_for_peer(
                    seq, self.running.values(), self.prefix_cache, self.checkpoint_before_last):
                held.append(seq)
                continue
            if not self._fits_memory(seq):  # it and those after it wait, in order
                held.extend(admitted[i:])
                break
            try:
                self._admit(seq)
            except Exception as e:  # one request's setup must never strand the others
                self._fail_setup(seq, e)
        self._requeue(held)
        if self.kv is not None:
            self._make_kv_room()
        if not self.running:
            if held:  # waiting for memory other models hold: do not spin
                time.sleep(0.02)
            return
        decoding = any(s.pipeline.completion_tokens for s in self.running.values())
        decoder = self.decoder
        decoder.set_prefill_chunk(self._prefill_chunk(decoding))
        with decoder.stats() as stats:
            prompt_responses, responses = decoder.next()
        self._observe(stats)
        self.steps += 1
        self.batch_sizes[min(len(self.running), self.max_num_seqs)] += 1
        track_prefill(prompt_responses, self.running)
        self._cache_finished_prompts(prompt_responses)
        self._decoder_cached_tokens(prompt_responses)
        for r in responses:
            found = self.running.get(r.uid)
            if found is None:
                continue
            seq = found
            if seq.error is not None:  # failed this step: its token is not trusted
                if r.finish_reason is not None:  # already out of the generator
                    del self.running[r.uid]
                    self._finish(seq, "error", seq.error)
                continue
            if seq.pipeline.stopped:  # a stop string fired on an earlier token of this step
                pass
            elif r.finish_reason == "stop" and r.token in seq.stop_token_ids:
                self._emit(seq, seq.pipeline.count_eos(self._logprob(seq, r.token, r.logprobs)))
            else:
                self._emit(seq, seq.pipeline.feed(r.token, self._logprob(seq, r.token, r.logprobs)))
            seq.generated.append(r.token)
            if r.finish_reason is not None:
                del self.running[r.uid]
                if r.prompt_cache:
                    self._cache(r.all_tokens, r.prompt_cache, seq.cache_key)
                self._finish(seq, r.finish_reason)
        stopped = [s for s in self.running.values() if s.pipeline.stopped]
        if stopped:
            self._remove(stopped, "stop", keep_cache=True)
        failed = [s for s in self.running.values() if s.error is not None]
        if failed:
            self._remove(failed, "error")
        if not self.running:
            # Idle: give freed memory back so the process returns to its resting size.
            release_free_memory()

    def _prefill_chunk(self, decoding: bool) -> int:
        """Prompt tokens to process this step: all of ``--prefill-step-size`` when nothing
        is decoding, else about ``PREFILL_INTERLEAVE`` decode steps' worth."""
        if not decoding or self._decode_step_s is None or self._prefill_tps is None:
            return self.prefill_step_size
        budget = int(self._prefill_tps * self._decode_step_s * PREFILL_INTERLEAVE)
        return max(MIN_PREFILL_CHUNK, min(self.prefill_step_size, budget))

    def _observe(self, stats: Any) -> None:
        if stats.generation_steps:
            step = stats.decode_time / stats.generation_steps
            self._decode_step_s = step if self._decode_step_s is None else \
                0.8 * self._decode_step_s + 0.2 * step
        if stats.prompt_tokens >= MIN_PREFILL_CHUNK and stats.prompt_time > 0:
            tps = stats.prompt_tokens / stats.prompt_time
            self._prefill_tps = tps if self._prefill_tps is None else \
                0.7 * self._prefill_tps + 0.3 * tps

    def _fits_memory(self, seq: Sequence) -> bool:
        """Admission by live KV: grant what ``seq`` is expected to hold, if it fits."""
        kv = self.kv
        if kv is None:
            return True
        n_prompt = len(seq.prompt.tokens) - seq.resumed_from
        need = kv.need(n_prompt, len(seq.generated), seq.max_tokens, seq.prompt.context_limited)
        fits = kv.admit(seq.seq_id, need)
        kv.waiting_for_memory = 0 if fits else len(self._waiting) + 1
        return fits

    def _make_kv_room(self) -> None:
        """Before a step: grow the grants of sequences that reach them; preempt the newest
        sequences when the grants would outgrow the allowance (kv_admission.py)."""
        assert self.kv is not None
        seqs = {s.seq_id: s for s in self.running.values()}
        preempted, ended = self.kv.grow(
            (s.seq_id, s.submitted_at, s.kv_tokens + 1,
             len(s.prompt.tokens) - s.resumed_from + s.max_tokens, s.resumable)
            for s in seqs.values())
        if ended:
            self._remove([seqs[i] for i in ended], "length", keep_cache=True)
        if preempted:
            self._preempt([seqs[i] for i in preempted])

    def _preempt(self, seqs: list[Sequence]) -> None:
        """Move sequences out of the batch, their KV state to the prefix cache, and requeue
        them at the head of the queue: each resumes from its prompt plus what it generated,
        most of it from the cache."""
        caches = self.decoder.remove([s.uid for s in seqs], return_caches=True)
        for seq in seqs:
            self.running.pop(seq.uid, None)
            found = caches.get(seq.uid)
            if found and self.prefix_cache is not None:
                # Now, not after the step: until its copy is made, the row's lazy slice
                # keeps the whole old batch buffer alive beside the step's new one.
                cache, toks = found
                self.prefix_cache.insert(list(toks), cache, seq.cache_key)
            log.info("request %s (prompt %d tokens) preempted for KV memory after %d output "
                     "tokens", seq.seq_id, len(seq.prompt.tokens) - seq.resumed_from,
                     len(seq.generated))
            seq.prompt = replace(seq.prompt, tokens=seq.prompt.tokens + seq.generated[
                seq.resumed_from:])
            seq.resumed_from = len(seq.generated)
        self._requeue(sorted(seqs, key=lambda s: s.submitted_at))

    def _admit(self, seq: Sequence) -> None:
        prompt = seq.prompt
        cache, n_cached = None, 0
        if self.prefix_cache is not None:
            seq.cache_key = self.prefix_cache.namespace(prompt.media_hashes, prompt.cache_salt)
            cache, n_cached = self.prefix_cache.fetch(prompt.tokens, seq.cache_key)
            # after the fetch: a key's new pin replaces the one this prompt resumes from
            self.prefix_cache.pin_prompt(prompt.tokens, prompt.cache_pins, prompt.cache_key,
                                         seq.cache_key)
        if not seq.resumed_from:  # a preempted sequence's usage and wait were counted
            seq.pipeline.set_cached_tokens(n_cached)
            seq.admitted()
        seq.n_cached = seq.prefilled = n_cached
        uid = self.decoder.insert(
            prompt, n_cached, cache, self._guarded_sampler(seq), self._guarded_processors(seq),
            seq.stop_token_ids, seq.max_tokens - len(seq.generated))
        seq.uid = uid
        self.running[uid] = seq

    def _decoder_cached_tokens(self, prompt_responses: list[Any]) -> None:
        """Usage's cached tokens from a decoder keeping its own prefix cache (mlx-vlm's),
        known only once it admits the prompt."""
        for r in prompt_responses:
            n = int(getattr(r, "cached_tokens", 0) or 0)
            seq = self.running.get(r.uid)
            if n and seq is not None:
                seq.pipeline.set_cached_tokens(n)

    def _prompt_checkpoint(self, r: Any) -> bool:
        """Whether the cache of ``r``'s sequence is at its prompt checkpoint now."""
        if self.checkpoint_before_last:  # the decoder's last segment is the last token
            return bool(getattr(r, "end_of_segment", False)) and not r.end_of_prompt
        return bool(r.end_of_prompt)

    def _cache_finished_prompts(self, prompt_responses: list[Any]) -> None:
        if self.prefix_cache is None:
            return
        uids = [r.uid for r in prompt_responses
                if self._prompt_checkpoint(r) and r.uid in self.running
                and len(self.running[r.uid].prompt_tokens) >= IN_FLIGHT_CACHE_MIN_TOKENS]
        if not uids:
            return
        for uid, (cache, toks) in self.decoder.extract_cache(uids).items():
            self._cache(list(toks), cache, self.running[uid].cache_key)

    def _remove(self, seqs: list[Sequence], reason: str, keep_cache: bool = False) -> None:
        if not seqs:
            return
        caches = self.decoder.remove([s.uid for s in seqs], return_caches=keep_cache)
        for seq in seqs:
            self.running.pop(seq.uid, None)
            found = caches.get(seq.uid) if keep_cache else None
            if found:
                cache, toks = found
                self._cache(list(toks), cache, seq.cache_key)
            self._finish(seq, reason, seq.error if reason == "error" else None)

    def close(self) -> None:
        super().close()
        self.decoder.close()


class SerialScheduler(SchedulerBase):
    """One sequence at a time through a ``SerialDecoder``; queued requests wait.

    With a prefix cache, a prompt resumes from the longest cached state it
    extends, and checkpoints are stored at the end of its prompt and of its
    generation (the decoder's ``prompt_state`` / ``final_state``).
    """

    mode = "serial"

    def __init__(self, decoder: SerialDecoder, tokenizer: Any, *, max_queue: int,
                 wake: Callable[[], None], prefix_cache: PrefixCache | None = None) -> None:
        super().__init__(tokenizer, max_num_seqs=1, max_queue=max_queue,
                         prefix_cache=prefix_cache, wake=wake)
        self.decoder = decoder
        self._current: tuple[Sequence, Iterator[tuple[Any, Any]]] | None = None

    def _step(self) -> None:
        admitted, cancelled = self._take(0 if self._current else 1)
        if self._current and self._current[0].seq_id in cancelled:
            seq = self._current[0]
            self._current = None
            self.decoder.final_state()  # let go of its cache (a cancelled turn is not kept)
            self.running.clear()
            self._finish(seq, "cancelled")
        if admitted:
            try:
                self._start(admitted[0])
            except Exception as e:  # end this request, not the worker
                self._current = None
                self.running.clear()
                self._fail_setup(admitted[0], e)
        if self._current is None:
            return
        seq, steps = self._current
        try:
            token, logprobs = next(steps)
        except StopIteration:
            self._end(seq, "length")
            return
        self.steps += 1
        self.batch_sizes[1] += 1
        if seq.error is not None:  # a processor or the sampler failed this step
            self._end(seq, "error")
            return
        token = int(token)
        lp = self._logprob(seq, token, logprobs)
        if token in seq.stop_token_ids:
            self._emit(seq, seq.pipeline.count_eos(lp))
            self._end(seq, "stop")
            return
        self._emit(seq, seq.pipeline.feed(token, lp))
        if seq.error is not None:
            self._end(seq, "error")
        elif seq.pipeline.stopped:
            self._end(seq, "stop")
        elif seq.pipeline.completion_tokens >= seq.max_tokens:
            self._end(seq, "length")

    def _start(self, seq: Sequence) -> None:
        prompt, pc = seq.prompt, self.prefix_cache
        cache, n_cached = None, 0
        if pc is not None:
            seq.cache_key = pc.namespace(prompt.media_hashes, prompt.cache_salt)
            cache, n_cached = pc.fetch(prompt.tokens, seq.cache_key)
            pc.pin_prompt(prompt.tokens, prompt.cache_pins, prompt.cache_key, seq.cache_key)
        seq.pipeline.set_cached_tokens(n_cached)
        seq.admitted()
        steps = self.decoder.start(
            prompt, self._guarded_sampler(seq), self._guarded_processors(seq), seq.max_tokens,
            cache=cache, n_cached=n_cached,
            checkpoint_prompt=pc is not None
            and len(prompt.tokens) >= IN_FLIGHT_CACHE_MIN_TOKENS)
        self._current = (seq, steps)
        self.running = {0: seq}
        while pc is not None and (state := self.decoder.prompt_state()) is not None:
            pc.insert(list(state[1]), state[0], seq.cache_key)

    def _end(self, seq: Sequence, reason: str) -> None:
        self._current = None
        self.running.clear()
        state = self.decoder.final_state()
        if self.prefix_cache is not None and state is not None and reason != "error":
            self.prefix_cache.insert(list(state[1]), state[0], seq.cache_key)
        self._finish(seq, reason, seq.error if reason == "error" else None)

    def _reset_after_failure(self) -> None:
        self._current = None

    def close(self) -> None:
        self._current = None
        super().close()
