"""Facts about the MLX device this process runs on."""

from __future__ import annotations

import ctypes
import gc
import sys
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


def release_free_memory() -> None:
    """Give freed memory back to the OS: MLX's buffer cache, then glibc's heap.

    glibc keeps freed heap memory in its arenas (and raises its mmap threshold
    after large frees), so without ``malloc_trim`` a burst of requests leaves the
    process's RSS high long after the buffers are gone. Call when idle.
    """
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


# glibc's mallopt parameter, and the size from which MLX's buffers get mappings of their own
M_MMAP_THRESHOLD = -3
MAP_BUFFERS_FROM = 1 << 20


def map_large_buffers(threshold: int = MAP_BUFFERS_FROM) -> None:
    """(Linux, glibc) Give every buffer of ``threshold`` bytes or more a mapping of its
    own, returned to the OS when it is freed. By default glibc raises its mmap threshold
    to the size of the largest buffer freed (up to 32 MiB), after which buffers below it
    come from its heap, where freed memory stays in the process: KV buffers that grow 256
    tokens at a time and are copied as rows join and leave the batch leave holes later
    buffers do not fit, and RSS grew ~0.8x the live KV past what MLX holds
    (``bench/kv_transient.py``). A fixed threshold turns that off. Process-wide and
    idempotent; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def release_thread_memory() -> None:
    """On a model's worker thread once its engine closed: collect the engine's cycles,
    wait for its stream's last work, and give the freed memory back to the OS."""
    gc.collect()
    mx.synchronize()
    release_free_memory()
