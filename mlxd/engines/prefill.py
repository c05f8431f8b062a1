"""Faster cold prefill on CPU.

Where a CPU prefill's time goes (SmolLM2-135M, float32, OpenBLAS; see the
s-hybrid note and ``bench/prefill.py``): the matmuls run on BLAS near its
rate, but attention's softmax does not. MLX's CPU ``exp`` costs about 4x
``power(2, x)`` per element, and a 2,000-token prompt prefilled as one
chunk exponentiates a 2,000 x 2,000 score matrix per head and layer, half
of it masked out by causality. Two fixes are ours:

- ``cpu_prefill_chunk``: prompts are prefilled in chunks of at most
  ``CPU_PREFILL_CHUNK`` tokens on CPU, so the masked-out upper triangle is
  mostly never computed (and the score matrices stay in cache).
- ``install_cpu_prefill_attention``: for multi-token queries on CPU,
  attention computes its softmax in base 2 (``power(2, .)`` on scores
  pre-scaled by log2(e)), the same function up to float rounding. Decode
  steps (one query), quantized caches, attention sinks and the GPU keep
  mlx-lm's path.

mlx-lm's model modules call ``scaled_dot_product_attention``, a name each
imports from ``mlx_lm.models.base``; the CPU path is installed by rebinding
that name in the loaded model's module, to a pure function with no state.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

CPU_PREFILL_CHUNK = 256
# Queries at least this long take the base-2 path (decode and speculative verify
# steps keep mlx-lm's kernel).
MIN_QUERY_TOKENS = 64
_LOG2E = 1.4426950408889634


def on_cpu() -> bool:
    """Whether MLX computes on the CPU here."""
    return bool(mx.default_device() == mx.cpu)


def cpu_prefill_chunk(step: int) -> int:
    """The prefill chunk to use for a configured ``--prefill-step-size`` of ``step``."""
    return min(step, CPU_PREFILL_CHUNK) if on_cpu() else step


def base2_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    mask: mx.array | str | None) -> mx.array:
    """Scaled dot-product attention with a base-2 softmax (grouped-query aware).

    ``mask``: ``"causal"``, a boolean array (True = attend) or an additive one.
    A row with every key masked gets a uniform (finite) distribution instead of NaN.
    """
    b, h, n_q, d = queries.shape
    h_kv, n_k = keys.shape[1], keys.shape[2]
    q = (queries * (scale * _LOG2E)).reshape(b, h_kv, h // h_kv, n_q, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # in log2 units
    lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
    if isinstance(mask, str):
        offset = n_k - n_q
        allowed = mx.arange(offset, offset + n_q)[:, None] >= mx.arange(n_k)[None]
        scores = mx.where(allowed, scores, lowest)
    elif mask is not None:
        if mask.ndim == 4:  # (b, h or 1, n_q, n_k) -> per key-value group
            mask = mask.reshape(mask.shape[0], -1, 1, n_q, n_k) if mask.shape[1] == 1 else \
                mask.reshape(mask.shape[0], h_kv, h // h_kv, n_q, n_k)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, lowest)
        else:
            scores = scores + mask.astype(scores.dtype) * _LOG2E
    scores = scores - mx.max(scores, axis=-1, keepdims=True)
    weights = mx.power(mx.array(2.0, scores.dtype), scores)
    weights = weights / mx.sum(weights, axis=-1, keepdims=True)
    out = weights @ mx.expand_dims(values, 2)
    return out.reshape(b, h, n_q, values.shape[-1])


def _cpu_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
              scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, base 2 for CPU prefill."""
    if (sinks is not None or hasattr(cache, "bits") or queries.shape[2] < MIN_QUERY_TOKENS
            or not on_cpu()):
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=scale, mask=mask, sinks=sinks)
    return base2_attention(queries, keys, values, scale, mask)


def install_cpu_prefill_attention(model: Any) -> bool:
    """Route ``model``'s attention through the CPU prefill path; True when installed.

    Only modules that call mlx-lm's own function are touched (idempotent).
    """
    if not on_cpu():
        return False
    # Attention layers may live in another architecture's module (qwen3_5 reuses qwen3_next's).
    names = {type(m).__module__ for m in model.modules()}
    installed = False
    for name in names:
        module: Any = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = _cpu_sdpa
            installed = True
        elif current is _cpu_sdpa:
            installed = True
    return installed
