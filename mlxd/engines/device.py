"""Facts about the MLX device this process runs on."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx


def device_name() -> str:
    dev = mx.default_device()
    return "gpu" if dev == mx.gpu else "cpu"


def preferred_float_dtype() -> str:
    """float32 on CPU (MLX's fp16/bf16 CPU kernels are slow); float16 on GPUs."""
    return "float16" if device_name() == "gpu" else "float32"


def weights_nbytes(model: Any) -> int:
    """Bytes of a model's parameters."""
    from mlx.utils import tree_flatten

    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(int(v.nbytes) for _, v in leaves if isinstance(v, mx.array))


def active_memory_bytes() -> int:
    return int(mx.get_active_memory())
