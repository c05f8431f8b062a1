"""Faster cold prefill on CPU.

Where a CPU prefill's time goes (SmolLM2-135M, float32, OpenBLAS; see
``bench/prefill.py`` and docs/benchmarks.md): the matmuls run on BLAS near its
rate, but the element-wise transcendental functions do not. MLX's CPU ``exp``
costs 12-15 ns an element on this 2-core Xeon (``power(2, .)`` about 6), against
0.6 ns for a multiply and under 1 ns for NumPy's SIMD ``exp``; attention
exponentiates a (query x key) score matrix per head and layer, and at a few
thousand tokens of context that was most of a prefill's time. Three fixes are
ours:

- ``cpu_prefill_chunk``: prompts are prefilled in chunks of at most
  ``CPU_PREFILL_CHUNK`` tokens on CPU, so the masked-out upper triangle is
  mostly never computed (and the score matrices stay in cache).
- ``install_cpu_prefill_attention``: on CPU, attention over more than a few
  thousand query x key scores per head (prefill chunks, and decode or verify
  steps deep into a long context) is computed by NumPy on the evaluated
  inputs' memory (``host_attention``:
  no copy in, one key-value group at a time, its softmax with NumPy's ``exp``),
  the same function up to float rounding. NumPy's own BLAS runs on one thread
  meanwhile, so its thread pool and MLX's do not spin against each other
  (``_limit_host_blas``). Short contexts, attention sinks and the GPU keep
  mlx-lm's path. Over a quantized cache (``--kv-bits``) every call dequantizes the
  cache a part at a time and takes this same float path (``quantized_attention``):
  mlx-lm's two ``quantized_matmul`` calls were 20x slower for prefill chunks.
  A 2,000-token prefill went from 11.0 s (the base-2 MLX softmax this
  replaced) to 5.1 s, 4,000 tokens from 37.9 s to 16.7 s.
- The same install computes the MLP's SwiGLU (``silu(gate) * x``, and the
  float32 ``precise_swiglu`` of Qwen3-Next's gated norm) in base 2
  for prefill chunks on CPU: ``gate / (1 + 2^(-gate * log2(e))) * x``, 2.1 ms
  instead of 6.7 ms per [256 x 1536] call (its output would have to be copied
  back from NumPy, which costs more than it saves here).

- Hybrid models' gated delta-net layers (Qwen3-Next, Qwen3.5) run their recurrence
  over a prefill chunk in the chunked matmul form (``chunked_delta``) instead of
  mlx-lm's per-token loop: a 1,024-token prefill of the benchmark's 131M hybrid
  went from 4.59 s to 2.85 s.
- Their depthwise convolutions (and Mamba-2's, Nemotron-H's) are computed as
  shifted multiply-adds (``depthwise_conv``), for prefill and decode alike, and
  the SiLU after them in base 2 over prefill chunks (``_cpu_silu``, reached by
  rebinding the model module's ``nn`` to ``mlx.nn`` with that one name changed):
  a 3,900-token prefill of the benchmark hybrid 16.6 -> 13.3 s with the gated
  norm's ``precise_swiglu`` (below).

mlx-lm's model modules call ``scaled_dot_product_attention``, ``swiglu``,
``precise_swiglu``, ``gated_delta_update`` and ``nn.silu``, names each imports
from ``mlx_lm.models.base``, ``.activations``, ``.gated_delta`` and ``mlx.nn``;
the CPU path is installed by rebinding those names in the loaded model's
modules (``PATHS``), to pure functions with no state.
Like every patch to upstream code (CONTRIBUTING.md, "Upstream internals"), it
is checked against the installed mlx-lm (an unchecked version must pass a numerical self-check, or
the model keeps mlx-lm's attention: this is a speed path, never a reason to
refuse a model), reference counted per module while models use it, and
undone when the last of them unloads (``PrefillAttention.undo``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations, base, gated_delta

from mlxd.engines.kernels.chunked_delta import LOG2E, cpu_gated_delta_update
from mlxd.engines.kernels.cpu_gemv import install_cpu_gemv
from mlxd.engines.kernels.depthwise_conv import install_cpu_depthwise_conv
from mlxd.engines.kernels.quantized_attention import dequantized_attention

log = logging.getLogger(__name__)

CPU_PREFILL_CHUNK = 256
# mlx-lm versions whose ``scaled_dot_product_attention`` signature and semantics were
# checked against ``host_attention`` (tests/test_prefill.py).
CHECKED_MLX_LM = ("0.32.2",)
# SwiGLU calls over at least this many tokens take the base-2 path (decode and
# speculative verify steps keep mlx-lm's).
MIN_QUERY_TOKENS = 64
# Attention calls with at least this many query x key scores per head take NumPy's path.
# One 9-head call (2-core Xeon, OpenBLAS): 1 query x 1,000 keys 0.55 ms in MLX and 0.59
# in NumPy; 9 x 1,000 2.2 and 0.6; 1 x 6,000 2.6 and 1.3; 9 x 6,000 (a speculative
# verify step deep into a session) 11.5 and 3.4; 256 x 6,000 222 and 53.
HOST_ATTENTION_MIN_SCORES = 4096
# Calls with at least this many scores in all are split over the cores (one BLAS thread
# each): a 4,000-token prefill 16.8 -> 11.4 s on 2 cores. Smaller ones (decode steps)
# run inline, where handing work to threads would cost more than it saves.
PARALLEL_MIN_SCORES = 1 << 20


def on_cpu() -> bool:
    """Whether MLX computes on the CPU here."""
    return bool(mx.default_device() == mx.cpu)


def cpu_prefill_chunk(step: int) -> int:
    """The prefill chunk to use for a configured ``--prefill-step-size`` of ``step``."""
    return min(step, CPU_PREFILL_CHUNK) if on_cpu() else step


def host_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                   mask: mx.array | str | None) -> mx.array:
    """Scaled dot-product attention computed by NumPy on the inputs' memory (grouped-query
    aware; float32 inside).

    MLX's CPU ``exp`` costs 12-15 ns an element here and ``power(2, .)`` about 6, while
    NumPy's SIMD ``exp`` into a preallocated array costs under 1 ns; the score matmuls
    go to BLAS either way. The inputs are evaluated and read in place (no copy), one
    key-value group (and, for large calls, one share of the queries per core) at a
    time, so a score matrix stays that part's size; only the output, (b, h, n_q, d), is
    copied back. ``mask``: ``"causal"``, a boolean array
    (True = attend) or an additive one. A row with every key masked gets a uniform
    (finite) distribution instead of NaN.
    """
    b, h, n_q, d = queries.shape
    h_kv, n_k = keys.shape[1], keys.shape[2]
    rep = h // h_kv
    dtype = queries.dtype
    q = (queries * scale).astype(mx.float32)
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    arrays = [q, k, v] + ([mask] if isinstance(mask, mx.array) else [])
    mx.eval(*arrays)
    qn, kn, vn = np.asarray(q), np.asarray(k), np.asarray(v)
    lowest = np.finfo(np.float32).min
    causal = isinstance(mask, str)
    if causal:  # only the last n_q keys can be in a query's future
        offset = n_k - n_q
        future = np.triu(np.full((n_q, n_q), lowest, np.float32), 1)
    elif mask is not None:
        mn = np.asarray(mask)
        mn = np.broadcast_to(mn.reshape((1,) * (4 - mn.ndim) + mn.shape), (b, h, n_q, n_k))
    out = np.empty((b, h, n_q, vn.shape[-1]), np.float32)

    def attend(i: int, g: int, rows: slice) -> None:
        """Queries ``rows`` of every head of batch row ``i``'s key-value group ``g``."""
        heads = slice(g * rep, (g + 1) * rep)
        part = qn[i, heads, rows]
        n = part.shape[1]
        scores = np.matmul(part.reshape(rep * n, d), kn[i, g].T)
        grid = scores.reshape(rep, n, n_k)
        if causal:
            grid[:, :, offset:] += future[rows]
        elif mask is not None:
            m = mn[i, heads, rows]
            if m.dtype == np.bool_:
                np.copyto(grid, lowest, where=np.logical_not(m))
            else:
                grid += m
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        weighted = np.matmul(scores, vn[i, g])
        weighted /= total
        out[i, heads, rows] = weighted.reshape(rep, n, -1)

    pool = _Installs.pool
    if pool is None or b * h * n_q * n_k < PARALLEL_MIN_SCORES:
        for i in range(b):
            for g in range(h_kv):
                attend(i, g, slice(0, n_q))
    else:  # every core: NumPy's BLAS runs on one thread (``_limit_host_blas``)
        parts = min(_Installs.workers, n_q)
        bounds = [n_q * p // parts for p in range(parts + 1)]
        tasks = [pool.submit(attend, i, g, slice(lo, hi)) for i in range(b)
                 for g in range(h_kv) for lo, hi in pairwise(bounds)]
        for task in tasks:
            task.result()
    return mx.array(out).astype(dtype)


def _float_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: Any) -> mx.array:
    """Attention over float KV on CPU: NumPy's for big calls, MLX's fused one else."""
    if queries.shape[2] * keys.shape[2] < HOST_ATTENTION_MIN_SCORES:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)
    return host_attention(queries, keys, values, scale, mask)


def _cpu_sdpa(queries: mx.array, keys: Any, values: Any, cache: Any,
              scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``; NumPy's for CPU prefill chunks, and over
    a quantized cache the dequantized float path (``quantized_attention``)."""
    if sinks is not None or not on_cpu():
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=scale, mask=mask, sinks=sinks)
    if hasattr(cache, "bits"):  # keys and values: (data, scales, biases)
        return dequantized_attention(queries, keys, values, scale, mask, cache.group_size,
                                     cache.bits, _float_attention)
    if queries.shape[2] * keys.shape[2] < HOST_ATTENTION_MIN_SCORES:
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=scale, mask=mask, sinks=sinks)
    return host_attention(queries, keys, values, scale, mask)


@mx.compile
def base2_silu(x: mx.array) -> mx.array:
    """``silu(x)`` with the sigmoid in base 2: ``x / (1 + 2^(-x log2 e))``."""
    return x / (1 + mx.power(2.0, x * -LOG2E))


def base2_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` with the sigmoid in base 2."""
    return base2_silu(gate) * x


def _prefill_chunk(x: mx.array) -> bool:
    """Whether ``x`` ([B, T, ...]) spans a CPU prefill chunk (decode and speculative
    verify steps do not, and keep mlx's own functions bit for bit)."""
    return x.ndim >= 3 and x.shape[1] >= MIN_QUERY_TOKENS and on_cpu()


def _cpu_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu``, base 2 for CPU prefill chunks (decode keeps mlx-lm's)."""
    if gate.ndim < 2 or gate.shape[-2] < MIN_QUERY_TOKENS or not on_cpu():
        return activations.swiglu(gate, x)
    return base2_swiglu(gate, x)


def _cpu_precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``precise_swiglu`` (float32 inside, ``h``'s dtype out; the gated norm of
    Qwen3-Next's delta-net layers), base 2 for CPU prefill chunks ([B, T, ...] inputs)."""
    if not _prefill_chunk(gate):
        return activations.precise_swiglu(h, gate, x)
    return base2_swiglu(gate.astype(mx.float32), x.astype(mx.float32)).astype(h.dtype)


def _cpu_silu(x: mx.array) -> mx.array:
    """``mlx.nn.silu``, base 2 for CPU prefill chunks ([B, T, ...] inputs): the
    activation after hybrid models' convolutions, 11.5 -> 4.1 ms per [259 x 2048]."""
    if not _prefill_chunk(x):
        return nn.silu(x)
    return base2_silu(x)


class _NNWithCpuSilu(types.ModuleType):
    """``mlx.nn`` as a model module sees it while the CPU path is installed: every name is
    mlx.nn's own but ``silu`` (``_cpu_silu``). Model code calls ``nn.silu(...)`` through
    its module's ``nn`` global, so rebinding that name reaches those calls only."""

    silu = staticmethod(_cpu_silu)

    def __getattr__(self, name: str) -> Any:
        return getattr(nn, name)


NN_WITH_CPU_SILU = _NNWithCpuSilu("mlx.nn")  # immutable: holds no state of its own


# (module attribute, mlx-lm's function, the CPU prefill path) rebound together
PATHS: tuple[tuple[str, Any, Any], ...] = (
    ("scaled_dot_product_attention", base.scaled_dot_product_attention, _cpu_sdpa),
    ("swiglu", activations.swiglu, _cpu_swiglu),
    ("precise_swiglu", activations.precise_swiglu, _cpu_precise_swiglu),
    ("nn", nn, NN_WITH_CPU_SILU),
    ("gated_delta_update", gated_delta.gated_delta_update, cpu_gated_delta_update),
)


def _gated_delta_ok(key: mx.array) -> bool:
    """Whether the chunked gated delta rule equals the installed mlx-lm's (a padded
    batch of a few chunks)."""
    keys = mx.random.split(key, 6)
    b, t, hk, hv, dk, dv = 2, 150, 2, 4, 16, 8
    q = mx.random.normal((b, t, hk, dk), key=keys[0])
    k = mx.random.normal((b, t, hk, dk), key=keys[1])
    q, k = q / mx.linalg.norm(q, axis=-1, keepdims=True) / 4, k / mx.linalg.norm(
        k, axis=-1, keepdims=True)
    v = mx.random.normal((b, t, hv, dv), key=keys[2])
    a, gate = mx.random.normal((b, t, hv), key=keys[3]), mx.random.normal((b, t, hv), key=keys[4])
    a_log, dt_bias = mx.random.normal((hv,), key=keys[5]), mx.zeros((hv,))
    real = mx.arange(t)[None] >= mx.array([[0], [21]])
    try:
        want, want_state = gated_delta.gated_delta_update(q, k, v, a, gate, a_log, dt_bias,
                                                          None, real)
    except Exception:
        return False
    got, state = cpu_gated_delta_update(q, k, v, a, gate, a_log, dt_bias, None, real)
    pick = real[..., None, None]
    return bool(mx.allclose(mx.where(pick, got, 0), mx.where(pick, want, 0), atol=1e-4).item()
                and mx.allclose(state, want_state, atol=1e-4).item())


def _self_check() -> bool:
    """Whether the CPU paths equal the installed mlx-lm's attention (GQA, causal; over
    float and quantized KV), SwiGLU and gated delta rule."""
    key = mx.random.key(0)
    q = mx.random.normal((1, 4, 80, 16), key=key)
    k = mx.random.normal((1, 2, 80, 16), key=mx.random.split(key)[0])
    v = mx.random.normal((1, 2, 80, 16), key=mx.random.split(key)[1])
    try:
        expected = base.scaled_dot_product_attention(q, k, v, cache=None, scale=0.25,
                                                     mask="causal")  # type: ignore[arg-type]
    except Exception:  # a changed signature: keep mlx-lm's path
        return False
    diff = float(mx.abs(host_attention(q, k, v, 0.25, "causal") - expected).max().item())  # type: ignore[arg-type]
    gate = mx.random.normal((1, 80, 48), key=key) * 8
    up = mx.random.normal((1, 80, 48), key=mx.random.split(key)[0])
    try:
        want = activations.swiglu(gate, up)
    except Exception:
        return False
    swiglu_ok = bool(mx.allclose(base2_swiglu(gate, up), want, rtol=1e-5, atol=1e-6).item())
    wide = (1, MIN_QUERY_TOKENS, 2, 24)
    h = mx.zeros(wide, dtype=mx.float16)
    gate, up = gate[:, :MIN_QUERY_TOKENS].reshape(wide), up[:, :MIN_QUERY_TOKENS].reshape(wide)
    try:
        want = activations.precise_swiglu(h, gate, up)
    except Exception:
        return False
    got = _cpu_precise_swiglu(h, gate, up)
    precise_ok = (got.dtype == want.dtype
                  and bool(mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()))
    silu_ok = bool(mx.allclose(_cpu_silu(gate), nn.silu(gate), rtol=1e-5, atol=1e-6).item())
    return (diff < 1e-4 and swiglu_ok and precise_ok and silu_ok and _gated_delta_ok(key)
            and _quantized_ok(key))


def _quantized_ok(key: mx.array) -> bool:
    """Whether attention over a dequantized cache equals the installed mlx-lm's over the
    quantized one (4 and 8 bits, GQA, causal)."""
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((1, 4, 80, 32), key=k1)
    k, v = mx.random.normal((1, 2, 80, 32), key=k2), mx.random.normal((1, 2, 80, 32), key=k3)
    for bits in (4, 8):
        qk, qv = (mx.quantize(x, group_size=32, bits=bits) for x in (k, v))
        try:
            want = base.quantized_scaled_dot_product_attention(
                q * 1, qk, qv, scale=0.25, mask="causal", group_size=32, bits=bits)  # type: ignore[arg-type]
        except Exception:
            return False
        got = dequantized_attention(q, qk, qv, 0.25, "causal", 32, bits, _float_attention)
        if not mx.allclose(got, want, atol=1e-4).item():
            return False
    return True


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
    one exception to "no module-level state", as for the vision patches. So is the
    thread limit on NumPy's own BLAS (``_limit_host_blas``), held while any model
    uses the path.
    """

    lock = threading.Lock()
    counts: dict[str, int] = {}
    blas_limit: Any = None
    pool: ThreadPoolExecutor | None = None  # host_attention's workers, one per core
    workers = 1


def _limit_host_blas() -> Any:
    """Run the BLAS libraries other than the one serving MLX's matmuls on one thread
    (threadpoolctl; returns the limit to restore, or None).

    ``host_attention``'s matmuls go to NumPy's BLAS (its wheel bundles its own
    OpenBLAS) between MLX's, which run on another one (the OpenBLAS ``mlxd serve``
    preloads). Two OpenBLAS thread pools on the same cores each spin while the other
    works: a 2,000-token SmolLM2 prefill took 11.1 s with both pools at two threads
    and 5.5 s with NumPy's at one (2-core box).
    """
    from threadpoolctl import ThreadpoolController

    from mlxd.blas import sgemm_provider

    mlx_blas = sgemm_provider()
    controller = ThreadpoolController()
    others = [lib for lib in controller.lib_controllers
              if lib.user_api == "blas" and lib.num_threads > 1
              and (mlx_blas is None or os.path.realpath(lib.filepath)
                   != os.path.realpath(mlx_blas))]
    if not others:
        return None
    return controller.select(filepath=[lib.filepath for lib in others]).limit(limits=1)


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
            if not _Installs.counts and _Installs.blas_limit is not None:
                _Installs.blas_limit.restore_original_limits()
                _Installs.blas_limit = None
            if not _Installs.counts and _Installs.pool is not None:
                _Installs.pool.shutdown(wait=False)
                _Installs.pool = None


def install_cpu_prefill_attention(model: Any, gemv: bool = True) -> PrefillAttention | None:
    """Route ``model``'s attention and SwiGLU through the CPU prefill paths until the
    handle's ``undo``.

    None when not installed (not on CPU, or the installed mlx-lm fails the check).
    Only modules that call mlx-lm's own functions are touched. On CPU the model's own
    depthwise convolutions are swapped for ``CpuDepthwiseConv1d`` and its float32
    linear layers for ``cpu_gemv``'s either way (those changes end with the model,
    nothing to undo). ``gemv=False`` leaves the linear layers to MLX (a sharded model:
    see ``ShardedLanguageModel.HOST_GEMV``).
    """
    if not on_cpu():
        return None
    install_cpu_depthwise_conv(model)
    if gemv:
        install_cpu_gemv(model)
    if not _upstream_ok():
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
        if held and _Installs.blas_limit is None:
            _Installs.blas_limit = _limit_host_blas()
        if held and _Installs.pool is None and (os.cpu_count() or 1) > 1:
            _Installs.workers = os.cpu_count() or 1
            _Installs.pool = ThreadPoolExecutor(_Installs.workers,
                                                thread_name_prefix="mlxd-attention")
    return PrefillAttention(held) if held else None
