"""A batched KV cache whose rows may hold masked-out slots: rejected drafts.

After a speculative verify step every row of a batch wrote the same number of
positions, but each keeps only its accepted ones. mlx-lm's ``BatchKVCache``
lays each row out as left padding then one contiguous run of tokens ending at
the batch's shared index, so a row that rejected more than the others had to
be shifted right over its whole history (``prepare(right_padding)`` +
``finalize``, a gather of every key and value): at batch 4 and a 5k-token
context on a 2-core CPU that took about a second per verify step, four plain
steps' worth, and made speculation a loss for any batch whose rows disagreed.

``GappedBatchKVCache`` leaves those slots where they are and masks them: a
row's rejected positions become *gaps*, excluded from attention by the mask
the cache makes (``make_mask``), and the row's RoPE offset moves back by what
it dropped, so its later tokens take the positions they would have had. A
rewind then costs a few small masks, whatever the context. Gaps live until the
row leaves the batch (``extract`` returns the row without them); a position is
never a gap once rewritten (``trim`` clears the gaps it cuts). Newcomers join
a running batch on its side (mlx-lm's ``_extend_cache`` extends the running
batch's caches with theirs), so ``extend`` here keeps both sides' gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engines.upstream import mlx_lm as lm_internals


class GappedBatchKVCache(BatchKVCache):
    """``BatchKVCache`` plus ``gaps``: a ``(rows, positions)`` boolean array, True where a
    slot holds a dropped token (None: no gaps)."""

    gaps: mx.array | None = None

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> GappedBatchKVCache:
        """Make ``cache`` (a plain ``BatchKVCache``, in place) a gapped one (a batch class
        with its own storage names its gapped form in ``gapped_class``)."""
        if not isinstance(cache, GappedBatchKVCache):
            cache.__class__ = getattr(cache, "gapped_class", cls)
            setattr(cache, "gaps", None)  # noqa: B010 (the instance's own attribute)
        return cache  # type: ignore[return-value]

    def _gaps_to(self, length: int) -> mx.array:
        rows, gaps = self.offset.shape[0], getattr(self, "gaps", None)
        if gaps is None:
            return mx.zeros((rows, length), dtype=mx.bool_)
        have = gaps.shape[1]
        if have >= length:
            return gaps[:, :length]
        return mx.concatenate([gaps, mx.zeros((rows, length - have), dtype=mx.bool_)],
                              axis=1)

    def drop(self, counts: Sequence[int], gaps: mx.array | None = None) -> mx.array | None:
        """Mask each row's last ``counts[i]`` positions before the index (already written,
        now dropped) and move its offset back by as many. ``gaps``: the result of the same
        call on another layer of the same batch (its layers share one layout), reused."""
        if not any(counts):
            return self.gaps
        if gaps is None:
            idx = self._idx
            pos = mx.arange(idx)[None]
            start = idx - mx.array(list(counts))[:, None]
            gaps = self._gaps_to(idx) | (pos >= start)
        self.gaps = gaps
        self.offset = self.offset - mx.array(list(counts))
        return gaps

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.gaps is None:
            return mask
        if not isinstance(mask, mx.array):
            mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                      **kwargs)
        keep = ~self._gaps_to(self._idx + N)
        return mask & keep[:, None, None, :]

    def trim(self, n: int) -> int:
        """Cut the last ``n`` slots of every row; a row's offset moves back only by the
        tokens among them (its gaps there were already taken off)."""
        end = self._idx
        n = super().trim(n)
        if self.gaps is not None and self.gaps.shape[1] > self._idx:
            cut = self.gaps[:, self._idx:end]
            self.offset = self.offset + cut.astype(self.offset.dtype).sum(axis=1)
            self.gaps = self.gaps[:, :self._idx]  # past the index every slot is rewritten
        return n

    def filter(self, batch_indices: Any) -> None:
        gaps, old_idx = self.gaps, self._idx
        super().filter(batch_indices)
        if gaps is not None:
            rows = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) \
                else batch_indices
            self.gaps = gaps[rows][:, old_idx - self._idx:]  # the left shift filter made

    def extend(self, other: Any) -> None:
        gapped = [c for c in (self, other) if getattr(c, "gaps", None) is not None]
        if not gapped or (self.keys is None and other.keys is None):
            super().extend(other)
            return
        top = max(self._idx, lm_internals.write_position(other))
        parts = []
        for c in (self, other):
            at = lm_internals.write_position(c)
            g = GappedBatchKVCache._gaps_to(c, at)
            parts.append(mx.pad(g, [(0, 0), (top - at, 0)]) if top > at else g)
        super().extend(other)
        self.gaps = mx.concatenate(parts, axis=0)

    def extract(self, idx: int) -> KVCache:
        if self.gaps is None:
            return super().extract(idx)
        assert self.keys is not None and self.values is not None  # gaps follow writes
        mx.eval(self.left_padding, self.gaps)
        start = int(np.array(self.left_padding)[idx])
        row = np.array(self._gaps_to(self._idx)[idx])
        kept = mx.array(start + np.flatnonzero(~row[start:self._idx]))
        cache = KVCache()
        cache.keys = mx.contiguous(mx.take(self.keys[idx:idx + 1], kept, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx:idx + 1], kept, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is not None and self.gaps is not None and self.keys is not None:
            length = self.keys.shape[2]
            shift = (mx.arange(length)[None] - padding[:, None]) % length
            self.gaps = mx.take_along_axis(self._gaps_to(length), shift, axis=1)
        super().finalize()


def drop_rows(caches: Sequence[Any], counts: Sequence[int]) -> None:
    """Mask each row's last ``counts[i]`` written positions in every ``BatchKVCache`` of
    ``caches`` (made gapped in place); other layers (recurrent states) are left alone."""
    shared: dict[tuple[int, int, int], mx.array | None] = {}
    for cache in caches:
        if not isinstance(cache, BatchKVCache) or cache.keys is None:
            continue
        gapped = GappedBatchKVCache.adopt(cache)
        key = (id(gapped.gaps), lm_internals.write_position(gapped), gapped.offset.shape[0])
        shared[key] = gapped.drop(counts, shared.get(key))
