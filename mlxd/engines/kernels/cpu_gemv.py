"""A text model's float32 matmuls over a few rows (decode steps), on CPU, through
BLAS's ``sgemv``.

MLX sends every float32 matmul to ``cblas_sgemm``, one row or many. OpenBLAS
0.3.21 (Debian's, the one ``mlxd serve`` preloads) runs a one-row ``sgemm`` with
its many-row kernel, at about the cost of a 16-row product; its ``sgemv`` reads
the weights once. On this 2-core box, the benchmark hybrid's tied head (49,152 x
768 float32, 151 MB): one row 18-25 ms by ``sgemm``, 5.5-8 ms by ``sgemv``; four
rows 28 ms by ``sgemm``, 24 ms as four ``sgemv`` calls; from five rows on
``sgemm`` wins. A 2,048 x 768 layer: one row 0.70 ms against 0.36, four rows
0.97 against 0.66.

A single-sequence decode step of the benchmark's 131M qwen3_next hybrid went
from 76-84 ms to 55-63 ms (4,000-6,000 tokens of context), SmolLM2-135M's
from 155 to 134 ms at 5,000 (steps interleaved in one process, medians).

``install_cpu_gemv`` swaps the class of a loaded model's plain float32
``nn.Linear`` modules, and of its ``nn.Embedding`` (used as the output head when
tied), for subclasses that compute calls of up to ``MAX_ROWS`` rows as one
``sgemv`` a row, in the library that serves MLX's own matmuls. Each such row is
computed alone, so these layers' output for a row does not depend on the other
rows of the call (bit for bit, up to ``MAX_ROWS`` rows; the rest of the model's
ops still may). Other calls, other dtypes
and libraries without ``cblas_sgemv`` keep MLX's matmul, and so do models
sharded over a group (``ShardedLanguageModel.HOST_GEMV``). The change lives on
that model's own modules and ends with it.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Up to this many rows, one sgemv per row is faster than one sgemm (measured above).
MAX_ROWS = 4
_ROW_MAJOR, _NO_TRANS = 101, 111


@cache
def blas_sgemv() -> Any:
    """``cblas_sgemv`` of the library whose ``cblas_sgemm`` serves MLX here, or None."""
    from mlxd.blas import sgemm_provider

    path = sgemm_provider()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).cblas_sgemv
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    fn.restype = None
    return fn


def gemv_rows(x: mx.array, weight: mx.array) -> mx.array | None:
    """``x @ weight.T`` with one ``sgemv`` per row of ``x``; None where it does not apply
    (not float32, more than ``MAX_ROWS`` rows, a weight not laid out row-major, no
    ``cblas_sgemv``)."""
    sgemv = blas_sgemv()
    n, k = weight.shape
    rows = x.size // k if x.ndim and x.shape[-1] == k else 0
    if (sgemv is None or not 0 < rows <= MAX_ROWS or x.dtype != mx.float32
            or weight.dtype != mx.float32):
        return None
    mx.eval(x, weight)
    w = np.asarray(weight)
    if not w.flags.c_contiguous:
        return None
    xs = np.ascontiguousarray(np.asarray(x).reshape(rows, k))
    out = np.empty((rows, n), np.float32)
    for r in range(rows):
        sgemv(_ROW_MAJOR, _NO_TRANS, n, k, 1.0, w.ctypes.data, k, xs[r].ctypes.data, 1, 0.0,
              out[r].ctypes.data, 1)
    return mx.array(out).reshape(*x.shape[:-1], n)


class CpuGemvEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied output head) goes through
    ``gemv_rows`` for a few rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = gemv_rows(x, self.weight)
        return super().as_linear(x) if y is None else y


class CpuGemvLinear(nn.Linear):
    """An ``nn.Linear`` computed by ``gemv_rows`` for a few rows."""

    def __call__(self, x: mx.array) -> mx.array:
        y = gemv_rows(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


def gemv_modules(model: Any) -> list[Any]:
    """``model``'s float32 modules ``CpuGemv*`` compute: its plain ``nn.Linear`` layers
    and ``nn.Embedding`` tables (an embedding's ``as_linear`` is the head when tied)."""
    return [m for m in model.modules()
            if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.float32]


def install_cpu_gemv(model: Any) -> int:
    """Compute ``model``'s few-row float32 matmuls by ``sgemv``; how many modules."""
    if blas_sgemv() is None:
        return 0
    found = gemv_modules(model)
    for module in found:
        module.__class__ = CpuGemvEmbedding if type(module) is nn.Embedding else CpuGemvLinear
    return len(found)
