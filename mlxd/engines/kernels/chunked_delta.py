"""The gated delta rule over a prompt in chunks, for hybrid models' prefill off Metal.

Gated delta-net layers (Qwen3-Next, Qwen3.5/3.6, OLMo-hybrid) carry a state
``S`` (``[Dv, Dk]`` per head) through the recurrence

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    y_t = S_t q_t.

mlx-lm runs it as a Metal kernel on Apple GPUs and otherwise as a Python loop
of small ops, one token at a time (``gated_delta_ops``): on CPU that loop was
2.9 s of a 5.0-s 1,024-token prefill of the benchmark's hybrid. The chunked
form computes the same function with matmuls (the WY form used for training
these layers, e.g. Yang et al., "Gated Delta Networks", 2024). Within a chunk
of ``C`` tokens, with ``L_t`` the running sum of ``log g`` and
``u_t = beta_t (v_t - g_t S_{t-1} k_t)``:

    S_t = e^{L_t} S_0 + sum_{i<=t} e^{L_t - L_i} u_i k_i^T

so the ``u`` solve a unit lower-triangular system

    (I + diag(beta) A) U = diag(beta) (V - diag(e^L) K S_0^T),
    A[t, i] = e^{L_t - L_i} k_t.k_i  (i < t),

and ``Y = diag(e^L) Q S_0^T + M U`` with ``M[t, i] = e^{L_t - L_i} q_t.k_i``
(i <= t), ``S_C = e^{L_C} S_0 + U^T diag(e^{L_C - L}) K``. The parts that do
not depend on ``S_0`` are computed for every chunk at once; only four matmuls
per chunk run in sequence. Decays stay in log space (no ratio of underflowed
products). A masked (padding) step is a step with ``g = 1, beta = 0``: it
leaves the state as it was, as mlx-lm's masked step does.

Used for prompts of at least ``MIN_TOKENS`` tokens with one decay per head;
shorter calls (decode, speculative verify and its replay) and per-channel
decays keep mlx-lm's function, so their results are mlx-lm's bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta

CHUNK = 32
MIN_TOKENS = 32
# A step's log decay is floored here: e^-30 (1e-13) forgets the state as surely as 0,
# and an infinite log decay (a huge gate input) would make L_t - L_t a NaN. The floor
# also bounds |L| over a chunk, and with it the rounding of L_t - L_i.
LOG_DECAY_FLOOR = -30.0
LOG2E = 1.4426950408889634


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array,
              lower_bound: float | None) -> mx.array:
    """``log g`` of mlx-lm's ``compute_g`` / ``compute_lower_bound_g``, without the
    final ``exp`` (so long products of small decays do not underflow)."""
    rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        return -rate * nn.softplus(a + dt_bias)
    return lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array,
                        beta: mx.array, state: mx.array, mask: mx.array | None = None,
                        chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The gated delta rule over ``T`` steps in chunks of ``chunk``.

    Shapes as mlx-lm's ``gated_delta_ops``: q, k ``[B, T, Hk, Dk]``; v
    ``[B, T, Hv, Dv]``; log_g, beta ``[B, T, Hv]``; state ``[B, Hv, Dv, Dk]``;
    mask ``[B, T]`` (true where the step is real). Returns y ``[B, T, Hv, Dv]`` in
    q's dtype and the state after the last step, in float32.
    """
    B, T, Hk = q.shape[:3]
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    f32 = mx.float32
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    log_g = mx.maximum(log_g.astype(f32), LOG_DECAY_FLOOR)
    beta = beta.astype(f32)
    if mask is not None:
        real = mask.astype(mx.bool_)[..., None]
        log_g = mx.where(real, log_g, 0.0)
        beta = mx.where(real, beta, 0.0)
    pad = -T % chunk
    n = (T + pad) // chunk

    def blocks(x: mx.array) -> mx.array:  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = x.astype(f32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return mx.moveaxis(x, 3, 1)

    Q, K, V = blocks(q), blocks(k), blocks(v)          # [B, H, n, C, D]
    L = mx.cumsum(blocks(log_g), axis=-1)              # [B, H, n, C]
    b = blocks(beta)
    causal = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), -1)
    gaps = L[..., :, None] - L[..., None, :]          # L_t - L_i
    # e^gaps as 2^(gaps log2 e): MLX's CPU exp costs ~25 ns an element, its power(2, .)
    # ~7 (prefill.py); 2^-inf = 0 above the diagonal
    decay = mx.power(2.0, mx.where(causal, gaps * LOG2E, -mx.inf))
    kk = (K @ mx.swapaxes(K, -1, -2)) * decay
    system = mx.where(strict, b[..., :, None] * kk, 0.0) + mx.eye(chunk, dtype=f32)
    inverse = mx.linalg.tri_inv(system, upper=False, stream=mx.cpu)
    grow = mx.exp(L)[..., None]                        # e^{L_t}
    u0 = inverse @ (b[..., None] * V)                  # [B, H, n, C, Dv]
    w = inverse @ (b[..., None] * grow * K)            # [B, H, n, C, Dk]
    qk = (Q @ mx.swapaxes(K, -1, -2)) * decay          # M, inclusive diagonal
    qg = grow * Q
    tail = mx.exp(L[..., -1:] - L)[..., None]          # e^{L_C - L_i}
    last = mx.exp(L[..., -1])[..., None, None]         # e^{L_C}
    s = state.astype(f32)
    ys = []
    for c in range(n):
        s_t = mx.swapaxes(s, -1, -2)                   # [B, H, Dk, Dv]
        u = u0[:, :, c] - w[:, :, c] @ s_t
        ys.append(qg[:, :, c] @ s_t + qk[:, :, c] @ u)
        s = last[:, :, c] * s + mx.swapaxes(u * tail[:, :, c], -1, -2) @ K[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.swapaxes(y, 1, 2).astype(out_dtype), s


def cpu_gated_delta_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array,
                           b: mx.array, A_log: mx.array, dt_bias: mx.array,
                           state: mx.array | None = None, mask: mx.array | None = None,
                           *, use_kernel: bool = True, lower_bound: float | None = None,
                           allow_neg_eigval: bool = False, **extra: Any
                           ) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``gated_delta_update`` with prompts of ``MIN_TOKENS`` or more run in
    chunks (same signature and contract: q and k normalised by the caller)."""
    upstream = gated_delta.gated_delta_update
    if extra or q.shape[1] < MIN_TOKENS:
        return upstream(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                        lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval, **extra)
    log_g = log_decay(A_log, a, dt_bias, lower_bound)
    if log_g.ndim != 3:  # a decay per key channel (Kimi Linear): mlx-lm's loop
        return upstream(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                        lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    return chunked_gated_delta(q, k, v, log_g, beta, state, mask)
