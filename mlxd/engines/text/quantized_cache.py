"""Quantized KV inside the batch (``--kv-bits``).

mlx-lm keeps one sequence's KV quantized (``QuantizedKVCache``: keys and values
as ``(data, scales, biases)`` from ``mx.quantize``, one group of
``group_size`` values per scale along the head dimension) and a batch's KV in
full precision (``BatchKVCache``). ``QuantizedBatchKVCache`` is the batched
form: the same layout as ``BatchKVCache`` (rows left-padded up to a shared write
index, ``prepare``/``finalize`` rolling right padding to the left, ``filter``,
``extend``, ``extract``, ``merge``, ``trim``, ``make_mask``) with each of keys
and values held as the quantized triple. mlx-lm's attention
(``models.base.scaled_dot_product_attention``) sees the cache's ``bits`` and
runs ``quantized_matmul`` on it, so a model needs no change.

Every position is quantized on its own (groups run along the head dimension),
so a row holds exactly the values a lone ``QuantizedKVCache`` would: a row
extracted from the batch *is* that cache, and the prefix cache stores it as is.
``QuantizedRowKVCache`` is the one-row cache the scheduler hands to mlx-lm's
``BatchGenerator``: a ``QuantizedKVCache`` that can ``merge`` into a batch.
Recurrent layers (``ArraysCache``) of hybrid models stay as they are.

Speculative decoding masks rejected draft positions (``gapped_cache.py``):
``GappedQuantizedBatchKVCache`` is that, on quantized storage.

On CPU the model's attention does not take mlx-lm's quantized path (two
``quantized_matmul`` calls, 20x slower there for prefill chunks): it dequantizes the
cache a part at a time and attends in float (``engines/kernels/quantized_attention.py``,
installed with the CPU prefill path); ``dequantized_head`` sizes that transient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
)

from mlxd.config import check_kv_bits, check_kv_group_size
from mlxd.engines.text.gapped_cache import GappedBatchKVCache
from mlxd.engines.upstream import mlx_lm as lm_internals

DEFAULT_KV_GROUP_SIZE = 64

_Triple = tuple[mx.array, mx.array, mx.array]


@dataclass(frozen=True)
class KVQuantization:
    """How attention layers keep their KV: ``bits`` per value, one scale and bias per
    ``group_size`` values of a head."""

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE

    def __post_init__(self) -> None:
        check_kv_bits(self.bits)
        check_kv_group_size(self.group_size)

    def bytes_per_value(self, dtype_bytes: int) -> float:
        """Bytes one K or V element takes: its bits plus its share of a scale and a bias
        (each of the model's float dtype)."""
        return self.bits / 8 + 2 * dtype_bytes / self.group_size


def _zeros(rows: int, heads: int, length: int, dim: int, dtype: mx.Dtype, bits: int,
           group_size: int) -> _Triple:
    """An all-zero quantized block (it dequantizes to zeros)."""
    per_word = 32 // bits
    return (mx.zeros((rows, heads, length, dim // per_word), dtype=mx.uint32),
            mx.zeros((rows, heads, length, dim // group_size), dtype=dtype),
            mx.zeros((rows, heads, length, dim // group_size), dtype=dtype))


def _map(f: Callable[[mx.array], mx.array], t: Sequence[mx.array]) -> _Triple:
    a, b, c = (f(x) for x in t)
    return a, b, c


def _dim(t: _Triple, bits: int) -> int:
    """The head dimension a quantized triple holds."""
    return int(t[0].shape[-1]) * (32 // bits)


class QuantizedBatchKVCache(BatchKVCache):
    """``BatchKVCache`` whose keys and values are quantized triples; see the module doc."""

    keys: Any  # (data, scales, biases), or None before the first write
    values: Any

    def __init__(self, left_padding: list[int], group_size: int = DEFAULT_KV_GROUP_SIZE,
                 bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            rows, heads = keys.shape[:2]
            length = (self.step + n - 1) // self.step * self.step
            new_k = _zeros(rows, heads, length, keys.shape[3], keys.dtype, self.bits,
                           self.group_size)
            new_v = _zeros(rows, heads, length, values.shape[3], keys.dtype, self.bits,
                           self.group_size)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                old_k, old_v = self.keys, self.values
                if prev % self.step != 0:
                    old_k = _map(lambda x: x[..., :prev, :], old_k)
                    old_v = _map(lambda x: x[..., :prev, :], old_v)
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_k, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2)
                                    for a, b in zip(old_v, new_v))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[_Triple, _Triple]:
        idx = self._idx
        return (_map(lambda x: x[..., :idx, :], self.keys),
                _map(lambda x: x[..., :idx, :], self.values))

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is not None:
            self.keys = _map(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.keys)
            self.values = _map(lambda x: dynamic_roll(x, padding[:, None], axis=2),
                               self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(cast(list[int], self.left_padding.tolist()))  # columns every row pads
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: Any) -> None:
        if self.keys is None and other.keys is None:
            super().extend(other)  # counters only
            return
        other_idx = lm_internals.write_position(other)
        top = max(self._idx, other_idx)
        full = self if self.keys is not None else other
        heads, dtype = full.keys[0].shape[1], full.keys[1].dtype
        dk, dv = _dim(full.keys, self.bits), _dim(full.values, self.bits)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: Any, at: int) -> tuple[_Triple, _Triple, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = _zeros(rows, heads, 0, dk, dtype, self.bits, self.group_size)
                v = _zeros(rows, heads, 0, dv, dtype, self.bits, self.group_size)
            left = top - at
            right = size - k[0].shape[2] - left
            if right < 0:
                k = _map(lambda x: x[..., :right, :], k)
                v = _map(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = _map(lambda x: mx.pad(x, widths), k)
                v = _map(lambda x: mx.pad(x, widths), v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self, self._idx), pad(other, other_idx)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = top

    def extract(self, idx: int) -> QuantizedKVCache:
        mx.eval(self.left_padding)
        start = cast(list[int], self.left_padding.tolist())[idx]
        return self._row(idx, lambda x: x[idx:idx + 1, :, start:self._idx])

    def _row(self, idx: int, cut: Callable[[mx.array], mx.array]) -> QuantizedKVCache:
        """Row ``idx`` as a lone ``QuantizedKVCache``, its positions picked by ``cut``."""
        cache: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is not None:
            cache.keys = _map(lambda x: mx.contiguous(cut(x)), self.keys)
            cache.values = _map(lambda x: mx.contiguous(cut(x)), self.values)
            cache.offset = int(cache.keys[0].shape[2])
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedBatchKVCache:
        """One batch from one-row caches: quantized ones, or full-precision ``KVCache``
        (quantized on the way in); at least one must be quantized (it gives the format)."""
        fmt = next(c for c in caches if isinstance(c, QuantizedKVCache))
        bits, group_size = fmt.bits, fmt.group_size
        rows = [quantized_row(c, bits, group_size) for c in caches]
        lengths = [c.offset if c.keys is not None else 0 for c in rows]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=group_size, bits=bits)
        if longest == 0:
            return batch
        full = next(c for c in rows if c.keys is not None)
        heads, dtype = full.keys[0].shape[1], full.keys[1].dtype
        dk, dv = _dim(full.keys, bits), _dim(full.values, bits)
        keys = _zeros(len(rows), heads, longest, dk, dtype, bits, group_size)
        values = _zeros(len(rows), heads, longest, dv, dtype, bits, group_size)
        for i, (p, c) in enumerate(zip(padding, rows)):
            if c.keys is None:
                continue
            for part in range(3):
                keys[part][i:i + 1, :, p:] = c.keys[part][..., :c.offset, :]
                values[part][i:i + 1, :, p:] = c.values[part][..., :c.offset, :]
        batch._hold(keys, values, longest)
        return batch

    def _hold(self, keys: _Triple, values: _Triple, length: int) -> None:
        """Take ``length`` written positions of every (left-padded) row."""
        self.keys, self.values = keys, values
        self.offset += length
        self._idx = length

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


class GappedQuantizedBatchKVCache(GappedBatchKVCache, QuantizedBatchKVCache):
    """``GappedBatchKVCache``'s masked rejected drafts on quantized storage (the gapped
    methods call the quantized ones underneath)."""

    def extract(self, idx: int) -> QuantizedKVCache:  # type: ignore[override]
        if self.gaps is None:
            return QuantizedBatchKVCache.extract(self, idx)
        mx.eval(self.left_padding, self.gaps)
        start = int(np.array(self.left_padding)[idx])
        row = np.array(self._gaps_to(self._idx)[idx])
        kept = mx.array(start + np.flatnonzero(~row[start:self._idx]))
        return self._row(idx, lambda x: mx.take(x[idx:idx + 1], kept, axis=2))


# ``GappedBatchKVCache.adopt`` turns a batch gapped in place, keeping its storage
QuantizedBatchKVCache.gapped_class = GappedQuantizedBatchKVCache  # type: ignore[attr-defined]


class QuantizedRowKVCache(QuantizedKVCache):
    """One sequence's quantized KV that merges into a ``QuantizedBatchKVCache`` (what
    mlx-lm's ``BatchGenerator`` asks of a row's cache)."""

    def size(self) -> int:
        return int(self.offset)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedBatchKVCache:
        return QuantizedBatchKVCache.merge(caches)


def quantized_row(cache: Any, bits: int, group_size: int,
                  row_class: type[QuantizedKVCache] = QuantizedRowKVCache) -> Any:
    """``cache`` (a ``QuantizedKVCache`` of this format, or a full-precision ``KVCache``)
    as a ``row_class`` (by default a row that merges into a batch); the arrays are shared,
    not copied."""
    row = row_class(group_size=group_size, bits=bits)
    if isinstance(cache, QuantizedKVCache):
        if (cache.bits, cache.group_size) != (bits, group_size):
            raise ValueError(f"a {cache.bits}-bit KV state (group {cache.group_size}) cannot "
                             f"join a {bits}-bit batch (group {group_size})")
        row.keys, row.values, row.offset = cache.keys, cache.values, cache.offset
    elif isinstance(cache, KVCache):
        if cache.keys is not None:
            q = cache.to_quantized(group_size=group_size, bits=bits)
            row.keys, row.values, row.offset = q.keys, q.values, q.offset
    else:
        raise TypeError(f"{type(cache).__name__} is not a KV cache")
    return row


def quantize_layers(cache: list[Any], kv: KVQuantization,
                    row_class: type[QuantizedKVCache] = QuantizedRowKVCache) -> list[Any]:
    """A model's per-layer cache with every attention layer (``KVCache`` or
    ``QuantizedKVCache``) a quantized ``row_class`` (by default a row that merges into a
    batch; a lone sequence takes ``QuantizedKVCache``); recurrent states (``ArraysCache``)
    as they are."""
    return [c if isinstance(c, ArraysCache) else
            quantized_row(c, kv.bits, kv.group_size, row_class) for c in cache]


def unsupported_layers(cache: list[Any]) -> list[str]:
    """The cache classes of ``cache`` (a fresh ``make_prompt_cache``) that quantized KV
    cannot stand in for (sliding windows, chunked or nested caches)."""
    return sorted({type(c).__name__ for c in cache
                   if type(c) not in (KVCache, QuantizedKVCache, ArraysCache)})


def dequantized_head(cache: list[Any]) -> tuple[int, int]:
    """(KV heads, bytes of one head's K for one token once dequantized) of the first
    quantized attention layer of ``cache`` that holds a token; (0, 0) when none does. On
    CPU attention dequantizes the cache a part at a time
    (``engines/kernels/quantized_attention.py``)."""
    for c in cache:
        if isinstance(c, QuantizedKVCache) and c.keys is not None:
            return int(c.keys[0].shape[1]), _dim(c.keys, c.bits) * c.keys[1].dtype.size
    return 0, 0
