"""Samplers and logits processors for one request, built on mlx-lm's sample_utils."""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlxd.generation.params import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

SEED_LIMIT = 2**64  # mx.random.key takes an unsigned 64-bit seed


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def build_sampler(params: SamplingParams) -> Sampler:
    """A sampler for one sequence.

    Greedy requests share one function object so a batch of them samples in a
    single call. A seeded request carries its own PRNG key, so its tokens do
    not depend on what else runs in the batch.
    """
    if params.greedy:
        return greedy
    top_p = params.top_p if 0.0 < params.top_p < 1.0 else 0.0
    if params.seed is None:
        return tag_sampling(make_sampler(temp=params.temperature, top_p=top_p,
                                         min_p=params.min_p, top_k=max(0, params.top_k)), params)
    return tag_sampling(_seeded_sampler(params, top_p), params)


def tag_sampling(sampler: Sampler, params: SamplingParams) -> Sampler:
    """Record on a (non-shared) sampler the settings it draws with: a draft model's
    rejection rule needs the distribution, not only a sample (``engines/text/draft.py``)."""
    sampler.sampling = params  # type: ignore[attr-defined]
    return sampler


def sampling_of(sampler: object) -> SamplingParams | None:
    """The settings ``tag_sampling`` recorded, if any."""
    params = getattr(sampler, "sampling", None)
    return params if isinstance(params, SamplingParams) else None


def _seeded_sampler(params: SamplingParams, top_p: float) -> Sampler:
    key = mx.random.key((params.seed or 0) % SEED_LIMIT)
    temp = params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if top_p:
            logprobs = apply_top_p(logprobs, top_p)
        if params.min_p:
            logprobs = apply_min_p(logprobs, params.min_p)
        if 0 < params.top_k < logprobs.shape[-1]:  # top_k >= vocabulary means "off"
            logprobs = apply_top_k(logprobs, params.top_k)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Penalties and logit bias (OpenAI semantics for presence/frequency)."""
    return make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
        repetition_context_size=64,
        presence_context_size=256,
        frequency_context_size=256,
    )


def heal_random_state() -> bool:
    """Reseed MLX's global PRNG if a failed compiled function left it unusable.

    mlx-lm's ``apply_top_k``/``apply_min_p``/``apply_top_p`` are compiled with
    ``mx.random.state`` as an input and output: an exception raised while one
    is traced leaves a placeholder array without a primitive in the global
    state, and every later unseeded sample fails ("Attempting to eval an
    array without a primitive"). Unseeded sampling promises no particular
    sequence, so a fresh random seed is a faithful repair. True if it healed.
    """
    try:
        mx.eval(mx.random.state[0])  # type: ignore[index]
        return False
    except Exception:
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        return True
