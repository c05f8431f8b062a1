"""Attention over a quantized KV cache on CPU: dequantize, then the float path.

mlx-lm attends over a quantized cache (``--kv-bits``) with two ``mx.quantized_matmul``
calls over the whole cache (``models.base.quantized_scaled_dot_product_attention``).
On the CPU those run far below BLAS: a long-context session with 8-bit KV was 7.6x
slower than without (issue 29). ``dequantized_attention`` instead dequantizes one
part of the cache at a time (``dequantize``: one fused pass, about twice as fast as
``mx.dequantize`` here) and hands it to the float attention the model would run
without quantized KV (``kernels/prefill.py``: NumPy's for big calls, MLX's fused one
for small ones). The stored KV stays quantized; only one part's dequantized K and V
exist at a time: a group of rows, or of one row's KV heads, of at most
``DEQUANTIZE_PART_BYTES`` (or one head, when one head is more), see
``dequantized_attention_bytes``.

One SmolLM2-135M attention layer (9 query heads, 3 KV heads of 64), 8-bit KV, group
64, float32, ms per call (``python -m bench.kv_attention``: best of two interleaved
rounds, 2-core AMD EPYC, OpenBLAS, load average 2.5-4.4 from another benchmark; ``float``
is the same call over float32 KV, the path without ``--kv-bits``):

=====================  ========  ===========  =====
rows x queries x keys  upstream  dequantized  float
=====================  ========  ===========  =====
1 x 256 x 1,024           274.2         15.6   15.9
1 x 256 x 6,144          1662.7        105.3   99.9
1 x 1 x 1,024              0.84         0.46   0.20
1 x 1 x 6,144              9.29         5.61   3.98
4 x 1 x 6,144             39.46        28.85  17.63
8 x 1 x 2,048             19.16        12.93  10.19
8 x 1 x 6,144             96.57        36.38  22.50
=====================  ========  ===========  =====

Prefill chunks are 15-18x faster (at float32 KV's speed), decode steps 1.3-3.8x (the
full table, 1-8 rows and 1k-6k keys: docs/benchmarks.md). Nowhere measured was
mlx-lm's quantized path faster on CPU, so the CPU takes this path for every call; the
GPU keeps mlx-lm's. A decode step stays slower than over float KV: it dequantizes the
whole cache each time (``mx.dequantize`` took twice as long as the fused pass), and
under the server's 1 MiB mmap threshold (``engines/device.py``) every part above 1 MiB
is a fresh mapping, page-faulted per layer and step: a 6,000-token decode in one
process ran 3.4 tok/s against float32's 8.8 with the threshold, 6.0 against 8.6
without. Dequantizing into a reused buffer is the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

# Dequantized K (and as much V) of one part of a call: rows, or one row's KV heads,
# are attended over in parts of at most this many bytes (at least one head each).
DEQUANTIZE_PART_BYTES = 8 << 20

Triple = tuple[mx.array, mx.array, mx.array]
# (queries, keys, values, scale, mask) -> output: the float attention
FloatAttention = Callable[[mx.array, mx.array, mx.array, float, "mx.array | str | None"],
                          mx.array]


def _affine(w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    return w.astype(scales.dtype) * scales + biases


def _affine_nibbles(w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    low = (w & 15).astype(scales.dtype) * scales + biases
    high = (w >> 4).astype(scales.dtype) * scales + biases
    return mx.stack([low, high], axis=-1)


# bytes of packed values -> the affine map, fused (one pass; shapeless: the cache grows)
_FUSED = {8: mx.compile(_affine, shapeless=True), 4: mx.compile(_affine_nibbles, shapeless=True)}


def dequantize(triple: Triple, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize(*triple, group_size=group_size, bits=bits)``, in one fused pass over
    the packed bytes for 8 and 4 bits (values are packed low bits first, so a byte holds
    one 8-bit value, or two 4-bit ones, low nibble first)."""
    w, scales, biases = triple
    fused = _FUSED.get(bits)
    if fused is None:
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    lead = w.shape[:-1]
    packed = mx.view(w, mx.uint8).reshape(*lead, scales.shape[-1], -1)
    return fused(packed, scales[..., None], biases[..., None]).reshape(*lead, -1)


def _mask_part(mask: mx.array | str | None, rows: slice, heads: slice
               ) -> mx.array | str | None:
    """The part of ``mask`` for ``rows`` and query ``heads`` (broadcast axes as they are)."""
    if not isinstance(mask, mx.array) or mask.ndim < 4:
        return mask
    return mask[rows if mask.shape[0] > 1 else slice(None),
                heads if mask.shape[1] > 1 else slice(None)]


def _parts(rows: int, kv_heads: int, head_bytes: int) -> list[list[tuple[slice, slice]]]:
    """(rows, KV heads) of each part, grouped by row when a row is split over heads."""
    budget = DEQUANTIZE_PART_BYTES
    if rows * kv_heads * head_bytes <= budget:
        return [[(slice(0, rows), slice(0, kv_heads))]]
    if kv_heads * head_bytes <= budget:
        step = max(1, budget // (kv_heads * head_bytes))
        return [[(slice(r, min(r + step, rows)), slice(0, kv_heads))]
                for r in range(0, rows, step)]
    step = max(1, budget // head_bytes)
    return [[(slice(r, r + 1), slice(h, min(h + step, kv_heads)))
             for h in range(0, kv_heads, step)] for r in range(rows)]


def dequantized_attention(queries: mx.array, q_keys: Triple, q_values: Triple, scale: float,
                          mask: mx.array | str | None, group_size: int, bits: int,
                          attend: FloatAttention) -> mx.array:
    """mlx-lm's ``quantized_scaled_dot_product_attention`` (same arguments; grouped-query
    heads, ``"causal"``, boolean or additive masks) computed by ``attend`` over the
    dequantized cache, in parts (see the module doc)."""
    rows, heads = queries.shape[:2]
    kv_heads, n_keys = q_keys[0].shape[1], q_keys[0].shape[2]
    rep = heads // kv_heads
    head_dim = q_keys[0].shape[-1] * 32 // bits
    head_bytes = n_keys * head_dim * q_keys[1].dtype.size

    def part(r: slice, h: slice) -> mx.array:
        q_heads = slice(h.start * rep, h.stop * rep)
        keys = dequantize((q_keys[0][r, h], q_keys[1][r, h], q_keys[2][r, h]), group_size, bits)
        values = dequantize((q_values[0][r, h], q_values[1][r, h], q_values[2][r, h]),
                            group_size, bits)
        return attend(queries[r, q_heads], keys, values, scale, _mask_part(mask, r, q_heads))

    groups = [[part(r, h) for r, h in group] for group in _parts(rows, kv_heads, head_bytes)]
    outs = [g[0] if len(g) == 1 else mx.concatenate(g, axis=1) for g in groups]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def dequantized_attention_bytes(rows: int, kv_heads: int, head_bytes_per_token: int,
                                context: int) -> int:
    """The most one attention call over quantized KV holds dequantized at once: K and V
    of one part (``DEQUANTIZE_PART_BYTES``, or one head at ``context`` tokens when that is
    more, never more than the whole batch's); ``head_bytes_per_token``: one head's
    dequantized K for one token (head dimension x the model's dtype bytes)."""
    head = head_bytes_per_token * context
    whole = rows * kv_heads * head
    return 2 * min(whole, max(DEQUANTIZE_PART_BYTES, head))
