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
- The same install computes the MLP's SwiGLU (``silu(gate) * x``) in base 2
  for prefill chunks on CPU: ``gate / (1 + 2^(-gate * log2(e))) * x``. The
  sigmoid's ``exp`` was the largest cost after the matmuls: in a 768-token
  SmolLM2 prefill (3 chunks of 256), the 90 SwiGLUs took 0.56 s of 2.47 s, and
  the base-2 form takes 2.1 ms instead of 6.7 ms per [256 x 1536] call.

mlx-lm's model modules call ``scaled_dot_product_attention`` and ``swiglu``,
names each imports from ``mlx_lm.models.base`` and ``.activations``; the CPU
path is installed by rebinding those names in the loaded model's modules, to
pure functions with no state.
Like every patch to upstream code (DESIGN.md), it is checked against the
installed mlx-lm (an unchecked version must pass a numerical self-check, or
the model keeps mlx-lm's attention: this is a speed path, never a reason to
refuse a model), reference counted per module while models use it, and
undone when the last of them unloads (``PrefillAttention.undo``).
"""

from __future__ import annotations

import logging
import sys
import threading
from importlib import metadata
from typing import Any

import mlx.core as mx
from mlx_lm.models import activations, base

log = logging.getLogger(__name__)

CPU_PREFILL_CHUNK = 256
# mlx-lm versions whose ``scaled_dot_product_attention`` signature and semantics were
# checked against ``base2_attention`` (tests/test_prefill.py).
CHECKED_MLX_LM = ("0.32.2",)
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


@mx.compile
def base2_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` with the sigmoid in base 2 (one fused kernel)."""
    return gate / (1 + mx.power(2.0, gate * -_LOG2E)) * x


def _cpu_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu``, base 2 for CPU prefill chunks (decode keeps mlx-lm's)."""
    if gate.ndim < 2 or gate.shape[-2] < MIN_QUERY_TOKENS or not on_cpu():
        return activations.swiglu(gate, x)
    return base2_swiglu(gate, x)


# (module attribute, mlx-lm's function, the CPU prefill path) rebound together
PATHS: tuple[tuple[str, Any, Any], ...] = (
    ("scaled_dot_product_attention", base.scaled_dot_product_attention, _cpu_sdpa),
    ("swiglu", activations.swiglu, _cpu_swiglu),
)


def _self_check() -> bool:
    """Whether the base-2 paths equal the installed mlx-lm's attention (GQA, causal) and
    SwiGLU."""
    key = mx.random.key(0)
    q = mx.random.normal((1, 4, 80, 16), key=key)
    k = mx.random.normal((1, 2, 80, 16), key=mx.random.split(key)[0])
    v = mx.random.normal((1, 2, 80, 16), key=mx.random.split(key)[1])
    try:
        expected = base.scaled_dot_product_attention(q, k, v, cache=None, scale=0.25,
                                                     mask="causal")  # type: ignore[arg-type]
    except Exception:  # a changed signature: keep mlx-lm's path
        return False
    diff = float(mx.abs(base2_attention(q, k, v, 0.25, "causal") - expected).max().item())  # type: ignore[arg-type]
    gate = mx.random.normal((1, 80, 48), key=key) * 8
    up = mx.random.normal((1, 80, 48), key=mx.random.split(key)[0])
    try:
        want = activations.swiglu(gate, up)
    except Exception:
        return False
    swiglu_ok = bool(mx.allclose(base2_swiglu(gate, up), want, rtol=1e-5, atol=1e-6).item())
    return diff < 1e-4 and swiglu_ok


def _upstream_ok() -> bool:
    try:
        version = metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        version = None
    if version in CHECKED_MLX_LM:
        return True
    if _self_check():
        log.warning("CPU prefill attention was checked against mlx-lm %s, not %s; its "
                    "self-check passed, so it is used", CHECKED_MLX_LM, version)
        return True
    log.warning("CPU prefill attention does not match mlx-lm %s's attention; keeping "
                "mlx-lm's (prefill stays slower on CPU)", version)
    return False


class _Installs:
    """Which model modules use the CPU path, and for how many loaded models.

    The rebinding is process-wide (a module attribute), so this record is too: the
    one exception to "no module-level state", as for the vision patches.
    """

    lock = threading.Lock()
    counts: dict[str, int] = {}


class PrefillAttention:
    """One loaded model's share of the CPU prefill path; ``undo`` releases it (idempotent)."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self._done = False

    def undo(self) -> None:
        if self._done:
            return
        self._done = True
        with _Installs.lock:
            for name in self.modules:
                left = _Installs.counts.get(name, 0) - 1
                if left > 0:
                    _Installs.counts[name] = left
                    continue
                _Installs.counts.pop(name, None)
                module: Any = sys.modules.get(name)
                for attr, upstream, ours in PATHS:
                    if getattr(module, attr, None) is ours:
                        setattr(module, attr, upstream)


def install_cpu_prefill_attention(model: Any) -> PrefillAttention | None:
    """Route ``model``'s attention and SwiGLU through the CPU prefill paths until the
    handle's ``undo``.

    None when not installed (not on CPU, or the installed mlx-lm fails the check).
    Only modules that call mlx-lm's own functions are touched.
    """
    if not on_cpu() or not _upstream_ok():
        return None
    # Attention layers may live in another architecture's module (qwen3_5 reuses qwen3_next's).
    names = sorted({type(m).__module__ for m in model.modules()})
    held: list[str] = []
    with _Installs.lock:
        for name in names:
            module: Any = sys.modules.get(name)
            uses = False
            for attr, upstream, ours in PATHS:
                current = getattr(module, attr, None)
                if current is upstream:
                    setattr(module, attr, ours)
                uses = uses or current is upstream or current is ours
            if not uses:
                continue
            _Installs.counts[name] = _Installs.counts.get(name, 0) + 1
            held.append(name)
    return PrefillAttention(held) if held else None
