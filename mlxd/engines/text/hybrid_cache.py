"""Serving models whose caches mix attention with recurrent layers.

Hybrid models (Qwen3.5 / Qwen3-Next gated delta-net, Nemotron-H and Mamba-2
SSMs, ...) keep an ``ArraysCache`` per recurrent layer: a fixed-size state
that cannot be trimmed back to a shorter prefix. They still batch in mlx-lm's
``BatchGenerator`` (the cache merges, extends and filters), and their prefix
reuse works from checkpoints: full cache states stored at message boundaries
(end of the leading system messages, end of a prompt, end of a generation) that
a later prompt extends exactly. The system-prompt checkpoint lets a new
conversation resume from the system prompt and tools it shares with others.

Batched prefill right-pads prompts of different lengths and relies on each
recurrent layer honouring ``cache.lengths`` so padding never enters its
state. Architectures checked to be exact that way prefill together; the
others (e.g. Nemotron-H, whose SSM update takes a mask but not the lengths,
so a resumed state is corrupted by padding) prefill one sequence at a time
and still decode in one batch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import mlx.core as mx

from mlxd.engines.text.decoder import CacheAndTokens, LogitsProcessor

# Recurrent layers that honour ``cache.lengths`` in padded batched prefill
# (checked by tests/test_hybrid_prefix.py against a lone run, resumed states included).
PADDED_PREFILL_EXACT = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "mamba2"})


def is_trimmable(cache: list[Any]) -> bool:
    """Whether every layer of ``cache`` can be cut back to a shorter prefix."""
    return all(getattr(c, "is_trimmable", lambda: False)() for c in cache)


def can_batch(cache: list[Any]) -> bool:
    """Whether every layer can be merged into a batch (``ArraysCache`` can)."""
    return all(hasattr(c, "merge") for c in cache)


def prefill_batch_size(model_type: str, cache: list[Any], max_num_seqs: int) -> int:
    """Prompts one prefill step may process together for a model with this ``cache``.

    Attention-only models and hybrids whose recurrent layers honour padding
    prefill ``max_num_seqs`` prompts at once; other hybrids one at a time.
    """
    if is_trimmable(cache) or model_type in PADDED_PREFILL_EXACT:
        return max_num_seqs
    return 1


def segments(tokens: list[int], n_cached: int, checkpoints: tuple[int, ...]) -> list[list[int]]:
    """The uncached part of a prompt, cut at its ``checkpoints`` (token offsets).

    ``BatchGenerator`` stops at each segment's end, where the scheduler stores the
    state; offsets already cached, or at the prompt's last token, are no cut.
    """
    cuts = sorted({c for c in checkpoints if n_cached < c < len(tokens) - 1})
    bounds = [n_cached, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in pairwise(bounds)]


def snapshot(cache: list[Any]) -> list[Any]:
    """A private, evaluated copy of ``cache`` (the live one keeps changing)."""
    mx.eval([c.state for c in cache])
    return copy.deepcopy(cache)


def prefill(model: Any, cache: list[Any], tokens: list[int], step: int) -> None:
    """Run ``tokens`` through ``model`` into ``cache`` in chunks of ``step`` (logits unused)."""
    for start in range(0, len(tokens), max(1, step)):
        model(mx.array(tokens[start:start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def with_context(processor: LogitsProcessor, context: list[int]) -> LogitsProcessor:
    """``processor`` seeing ``context`` before the tokens it is given, for a generation
    started after part of its prompt was already in the cache."""
    head = mx.array(context, dtype=mx.uint32)

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.concatenate([head, tokens.astype(mx.uint32)]), logits)

    return run


class SerialRun:
    """One serial generation's cache and the tokens it covers, for checkpoints.

    ``prompt_states`` are the prompt's checkpoints, the last covering the prompt
    but its last token (that one is fed with the first decode step). mlx-lm's ``generate_step`` feeds each token
    before yielding it, so once a token was yielded the live cache covers the
    prompt and every token yielded so far: ``final_state`` at the end.
    """

    def __init__(self, cache: list[Any], prompt: list[int],
                 prompt_states: list[CacheAndTokens]) -> None:
        self.cache = cache
        self.tokens = list(prompt)
        self.prompt_states = prompt_states

    def track(self, steps: Iterator[tuple[Any, mx.array]]) -> Iterator[tuple[Any, mx.array]]:
        """``steps``, recording each yielded token as covered by the cache."""
        for token, logprobs in steps:
            self.tokens.append(int(token))
            yield token, logprobs

    def final_state(self) -> CacheAndTokens:
        """The cache and the tokens it covers now (call once the generation ended)."""
        return self.cache, self.tokens
