"""Rewinding the recurrent layers of a hybrid model after a speculative verify step.

A verify step runs every row over ``[pending, d1..dK]``. Attention layers keep a
KV cache that is cut back per row to what the row accepted
(``speculative.rewind_rows``). A recurrent layer (gated delta-net) keeps a
fixed-size state instead, which after the step has absorbed every position, the
rejected drafts and padding included, and which cannot be cut back.

``RecurrentReplay`` rewinds such a layer by replay. During the verify forward it
records each recurrent layer's input (the normalised hidden states the layer
received: they do not depend on that layer's cache, and the positions up to a
row's last accepted one are what a plain step would have produced). After the
compare, each recurrent layer is restored to its state before the step and run
again on its recorded input with ``cache.lengths`` set to what each row kept:
the layer masks the positions past a row's length out of its state update and
takes its convolution state at the row's own end, exactly as in mlx-lm's padded
batched prefill. Only the recurrent layers run again, not the attention layers,
the MLPs or the head; and only when some row rejected something.

Only layer types checked to honour ``lengths`` that way are replayed
(``REPLAYABLE``: Qwen3-Next's and Qwen3.5's gated delta-net, tested by
``tests/test_speculative.py`` against decoding without speculation). A model
with any other non-KV cache (Mamba-2, sliding-window attention, ...) does not
speculate.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache

from mlxd.engines.text.gapped_cache import GappedBatchKVCache
from mlxd.engines.text.quantized_cache import (
    GappedQuantizedBatchKVCache,
    QuantizedBatchKVCache,
    QuantizedRowKVCache,
)

# attention caches a rejected draft rewinds by trimming or masking
_KV_TYPES = (BatchKVCache, GappedBatchKVCache, KVCache, QuantizedBatchKVCache,
             GappedQuantizedBatchKVCache, QuantizedKVCache, QuantizedRowKVCache)


def _replayable() -> tuple[type, ...]:
    """The recurrent layer classes whose ``__call__(inputs, mask, cache)`` honours
    ``cache.lengths`` (mask past each row's length, conv state at each row's end)."""
    from mlx_lm.models.qwen3_5 import GatedDeltaNet
    from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

    return (Qwen3NextGatedDeltaNet, GatedDeltaNet)


# (cache contents, left padding, lengths) of one ArraysCache before the verify step
_Saved = tuple[list[Any], Any, Any]


class RecurrentReplay:
    """The recurrent layers of one model, by cache index, and how to rewind them."""

    def __init__(self, modules: dict[int, Any]) -> None:
        self.modules = modules
        self._inputs: dict[int, mx.array] = {}  # id(module) -> its input in this step
        self._recorders = {cls: self._recorder(cls) for cls in {type(m) for m in modules.values()}}

    @classmethod
    def find(cls, model: Any, caches: list[Any]) -> RecurrentReplay | None:
        """The replay for ``model`` whose per-layer ``caches`` are plain KV caches or
        recurrent states of replayable layers; None when some layer cannot be rewound
        (an empty replay when there is no recurrent layer)."""
        layers = getattr(model, "layers", None)
        if layers is None or len(layers) != len(caches):
            return None
        replayable = _replayable()
        modules: dict[int, Any] = {}
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            if type(cache) in _KV_TYPES:
                continue
            module = getattr(layer, "linear_attn", None)
            if type(cache) is not ArraysCache or type(module) not in replayable:
                return None
            modules[i] = module
        return cls(modules)

    def _recorder(self, base: type) -> type:
        """A subclass of ``base`` whose call records its input, swapped in during a step."""
        inputs = self._inputs

        def __call__(module: Any, x: mx.array, mask: Any = None, cache: Any = None) -> Any:
            inputs[id(module)] = x
            return base.__call__(module, x, mask, cache)

        return type(f"Recording{base.__name__}", (base,), {"__call__": __call__})

    def save(self, caches: list[Any]) -> dict[int, _Saved]:
        """The recurrent states before a step (free: the layers assign new state arrays;
        the padding counters, which ``advance`` decrements in place, are copied)."""
        def copy(a: mx.array | None) -> mx.array | None:
            return None if a is None else mx.array(a)

        return {i: (list(caches[i].cache), copy(caches[i].left_padding), copy(caches[i].lengths))
                for i in self.modules}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record each recurrent layer's input during the forward run inside."""
        self._inputs.clear()
        originals = {i: type(m) for i, m in self.modules.items()}
        try:
            for m in self.modules.values():
                m.__class__ = self._recorders[type(m)]
            yield
        finally:
            for i, m in self.modules.items():
                m.__class__ = originals[i]

    def rewind(self, caches: list[Any], saved: dict[int, _Saved], keep: list[int],
               width: int) -> None:
        """Make each recurrent state cover the first ``keep[i]`` of the step's ``width``
        positions of row ``i`` (from the state before the step and the recorded inputs)."""
        for i, module in self.modules.items():
            cache = caches[i]
            state, left_padding, _ = saved[i]
            cache.cache = list(state)
            cache.left_padding = left_padding
            # one array per layer: the layer's ``cache.advance`` subtracts in place
            cache.lengths = mx.array(keep)
            # the layer's output is never evaluated: only the state it writes is used
            module(self._inputs[id(module)], cache.make_mask(width), cache)
            cache.lengths = None
            cache.left_padding = None if left_padding is None else left_padding - mx.array(keep)
        self._inputs.clear()
