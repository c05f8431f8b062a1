"""What a scheduler needs from the library that decodes, and nothing more.

The schedulers in ``engines/text/scheduler.py`` queue requests, admit them, key the
prefix cache and turn tokens into events; a ``Decoder`` owns the model and the
batched KV state. ``engines/text/mlx_lm_decoder.py`` implements both interfaces over
mlx-lm (token prompts); a vision-language engine implements them over
mlx-vlm's ``BatchGenerator``, which computes each request's input embeddings
from ``prompt.tokens`` and ``prompt.media``.

Each call is made on the model's worker thread, except ``cache_nbytes``,
which ``memory_bytes`` reads from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from mlxd.engines.text.input_processor import PreparedPrompt

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
CacheAndTokens = tuple[list[Any], list[int]]  # a KV cache and the tokens it covers


class PromptProgress(Protocol):
    """A prefill step's report for one sequence."""

    uid: int
    end_of_prompt: bool


class TokenResponse(Protocol):
    """A decode step's report for one sequence: its new token."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None  # "stop" / "length" when the sequence left the batch
    prompt_cache: list[Any] | None  # set with finish_reason: the KV state of all_tokens
    all_tokens: list[int]


class StepStats(Protocol):
    """Work done during one ``stats()`` window (read to size prefill chunks)."""

    generation_steps: int
    decode_time: float
    prompt_tokens: int
    prompt_time: float


class Decoder(Protocol):
    """Continuous batching: sequences join with ``insert`` and leave by finishing or ``remove``."""

    def next(self) -> tuple[list[PromptProgress], list[TokenResponse]]:
        """One step: a prefill chunk and/or one decode step of every running sequence."""

    def stats(self) -> AbstractContextManager[StepStats]:
        """A window, around ``next``, whose ``StepStats`` count the work done in it."""

    def insert(self, prompt: PreparedPrompt, n_cached: int, cache: list[Any] | None,
               sampler: Sampler, processors: list[LogitsProcessor], stop: set[int],
               max_tokens: int) -> int:
        """Start decoding ``prompt``; ``cache`` (when given) covers its first ``n_cached``
        tokens. Returns the sequence's uid."""

    def remove(self, uids: list[int], return_caches: bool = False) -> dict[int, CacheAndTokens]:
        """Drop sequences; with ``return_caches`` also hand back their KV states."""

    def extract_cache(self, uids: list[int]) -> dict[int, CacheAndTokens]:
        """Copies of running sequences' KV states (for the prefix cache)."""

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens the next prefill step may process."""

    def cache_nbytes(self) -> int:
        """Bytes the batch's KV states hold now."""

    def reset(self) -> None:
        """Drop every sequence and start empty (after a step failed for the whole batch)."""

    def close(self) -> None:
        """Release what the decoder holds."""


@runtime_checkable
class DraftCounting(Protocol):
    """A decoder that speculates (``engines/text/speculative.py``) reports its draft tokens."""

    def draft_counts(self, uids: list[int]) -> dict[int, tuple[int, int]]:
        """(accepted, rejected) draft tokens of sequences that left; forgotten once read."""

    def draft_totals(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens since the decoder started."""


class SerialDecoder(Protocol):
    """One sequence at a time, for models whose KV caches cannot be batched."""

    def start(self, prompt: PreparedPrompt, sampler: Sampler,
              processors: list[LogitsProcessor], max_tokens: int,
              cache: list[Any] | None = None, n_cached: int = 0,
              checkpoint_prompt: bool = False) -> Iterator[tuple[Any, mx.array]]:
        """An iterator of ``(token, logprobs)``, one per decode step. ``cache`` (when
        given) covers the first ``n_cached`` prompt tokens; ``checkpoint_prompt`` asks
        for ``prompt_state``."""

    def prompt_state(self) -> CacheAndTokens | None:
        """The prompt's next checkpoint, each taken once (None when none is left): a copy
        of the cache and the tokens it covers, at each of the prompt's ``checkpoints``,
        then after the prompt but its last token."""

    def final_state(self) -> CacheAndTokens | None:
        """The ended generation's cache and the tokens it covers (prompt and output)."""
