"""A faster erf-GELU for encoder models on MLX's CPU backend.

MLX computes ``erf`` on the CPU one element at a time through libm: in
all-MiniLM-L6-v2 the exact GELU takes about a third of a forward pass, while
the matrix products run on BLAS. ``gelu_rational`` evaluates erf with the
rational approximation Eigen and XLA use for float32 (max error about 6e-7 on
erf, 1.5e-6 on GELU), only multiplies and adds that ``mx.compile`` fuses into
one kernel: 2-3x faster than ``nn.gelu`` on CPU (without a C++ compiler MLX
runs it uncompiled, still ~1.8x faster).

``use_fast_gelu(model)`` swaps it in for the exact ``nn.GELU()`` modules of one
loaded model instance, after checking it against ``nn.gelu`` on a probe; the
swap dies with the instance, nothing global changes. Engines apply it on CPU
only: GPU kernels compute erf fast.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# erf(z) ~= z * P(z^2) / Q(z^2) on [-4, 4] (Eigen's generic_fast_erf_float).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)
_SQRT_HALF = 0.7071067811865476
#: Largest |fast - exact| accepted on the probe before a swap.
TOLERANCE = 1e-5


def gelu_rational(x: mx.array) -> mx.array:
    """``x * Phi(x)`` with erf from a rational approximation (float32-accurate)."""
    z = mx.clip(x * _SQRT_HALF, -4.0, 4.0)
    z2 = z * z
    p: Any = _ERF_P[0]
    for c in _ERF_P[1:]:
        p = p * z2 + c
    q: Any = _ERF_Q[0]
    for c in _ERF_Q[1:]:
        q = q * z2 + c
    return 0.5 * x * (1.0 + z * p / q)


class RationalGELU(nn.Module):
    """Drop-in for ``nn.GELU()`` (the erf form), compiled once for every shape."""

    def __init__(self) -> None:
        super().__init__()
        self._fn = mx.compile(gelu_rational, shapeless=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self._fn(x)


def agrees_with_exact_gelu(fast: nn.Module) -> bool:
    """True when ``fast`` matches ``nn.gelu`` within ``TOLERANCE`` on [-12, 12]."""
    probe = mx.linspace(-12.0, 12.0, 8193)
    error = float(mx.abs(fast(probe) - nn.gelu(probe)).max().item())  # type: ignore[arg-type]
    return error <= TOLERANCE


def _is_exact_gelu(module: Any) -> bool:
    return type(module) is nn.GELU and getattr(module, "_approx", None) == "none"


def use_fast_gelu(model: nn.Module) -> int:
    """Replace ``model``'s exact ``nn.GELU()`` modules with ``RationalGELU``; how many."""
    fast = RationalGELU()
    if not agrees_with_exact_gelu(fast):
        return 0
    swapped = 0
    for _, module in model.named_modules():
        for key, child in list(module.children().items()):
            if _is_exact_gelu(child):
                setattr(module, key, fast)
                swapped += 1
            elif isinstance(child, list):  # e.g. nn.Sequential's layers
                stored = module[key]  # children() hands back a copy of the list
                for i, item in enumerate(stored):
                    if _is_exact_gelu(item):
                        stored[i] = fast
                        swapped += 1
    return swapped
