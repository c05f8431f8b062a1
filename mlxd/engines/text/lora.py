"""LoRA adapters over one loaded base model, each row of a batch with its own.

Every linear layer some adapter targets becomes a ``MultiLoRALinear``: it keeps
the base layer and, stacked along a first axis, every adapter's low-rank factors
(slot 0 is "no adapter": zeros). A forward computes, per row ``i`` of the batch,

    base(x_i) + scale[s_i] * ((x_i @ A[s_i]) @ B[s_i])

with ``s_i`` the row's slot: the factors are gathered per row, the way batched
multi-LoRA kernels do it, and the base weights are never merged, so requests
for the base model and for different adapters share one batch. Ranks may differ:
smaller ones are zero-padded to the largest, which adds exact zeros.

``AdapterRows`` is the one piece of per-row state inside the model forward: the
decoder assigns each sequence's slot when it joins (``assign``), and the batch
that runs a forward names its rows (``rows``) for the layers to read. Slots come
from the server (the request's model name), never from a client, and are still
checked against the number of adapters: MLX does not bounds-check a gather on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from mlxd.engines.upstream import mlx_lm as lm_internals
from mlxd.models.adapters import AdapterError, AdapterInfo


class AdapterRows:
    """Which adapter slot each sequence uses, and the rows of the forward being run."""

    def __init__(self, slots: int) -> None:
        self.slots = slots  # adapters loaded: valid slots are 0 (none) .. slots
        self._by_uid: dict[int, int] = {}
        self.current: mx.array | None = None  # None: every row runs the base model

    def check(self, slot: int) -> int:
        if not 0 <= slot <= self.slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.slots}]")
        return slot

    def assign(self, uid: int, slot: int) -> None:
        if self.check(slot):
            self._by_uid[uid] = slot
        else:
            self._by_uid.pop(uid, None)

    def forget(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._by_uid.pop(uid, None)

    def clear(self) -> None:
        """Forget every sequence (a new batch generator numbers its own from 0)."""
        self._by_uid.clear()
        self.current = None

    def set_slots(self, slots: list[int]) -> None:
        """The slots of the next forwards' rows, in batch order."""
        self.current = mx.array([self.check(s) for s in slots], dtype=mx.int32) \
            if any(slots) else None

    @contextmanager
    def rows(self, uids: Iterable[int]) -> Iterator[None]:
        """Forwards inside run the sequences ``uids`` (in batch order)."""
        before = self.current
        self.set_slots([self._by_uid.get(u, 0) for u in uids])
        try:
            yield
        finally:
            self.current = before


class MultiLoRALinear(nn.Module):
    """A linear layer plus every adapter's low-rank update, chosen per row."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array,
                 scales: mx.array, rows: AdapterRows) -> None:
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # (slots + 1, in, rank)
        self.lora_b = lora_b  # (slots + 1, rank, out)
        self.lora_scale = scales  # (slots + 1,)
        self.adapter_rows = rows
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self.adapter_rows.current
        if slots is None:
            return y
        if x.shape[0] != slots.shape[0]:
            raise RuntimeError(f"a batch of {x.shape[0]} rows ran with adapter slots for "
                               f"{slots.shape[0]}")
        a, b = self.lora_a[slots], self.lora_b[slots]
        if x.ndim == 2:  # (rows, in): one token per row
            z = ((x[:, None] @ a) @ b)[:, 0]
            s = self.lora_scale[slots][:, None]
        else:
            z = (x @ a) @ b
            s = self.lora_scale[slots][:, None, None]
        return y + (s * z).astype(x.dtype)


def _with_slot(stack: mx.array, slot: int, size: int, value: mx.array | None) -> mx.array:
    """``stack`` grown to ``size`` slots (zeros), with slot ``slot`` set to ``value``
    (None: zeros). Always a new array: a forward still holding the old one keeps it."""
    if stack.shape[0] < size:
        grow = mx.zeros((size - stack.shape[0], *stack.shape[1:]), stack.dtype)
        stack = mx.concatenate([stack, grow])
    row = mx.zeros(stack.shape[1:], stack.dtype) if value is None else value.astype(stack.dtype)
    return mx.concatenate([stack[:slot], row[None], stack[slot + 1:size]])


def _padded(x: mx.array, rank: int, axis: int) -> mx.array:
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, rank - x.shape[axis])
    return mx.pad(x, pads) if rank > x.shape[axis] else x


def _put(layer: MultiLoRALinear, slot: int, size: int, factors: tuple[mx.array, mx.array] | None,
         scale: float) -> None:
    """Give ``layer``'s slot ``slot`` these factors (None: zeros), the stacks ``size`` long
    and padded to the largest rank."""
    rank = max(layer.lora_a.shape[2], factors[0].shape[1] if factors else 0)
    a, b = (None, None) if factors is None else factors
    layer.lora_a = _with_slot(_padded(layer.lora_a, rank, 2), slot, size,
                              None if a is None else _padded(a, rank, 1))
    layer.lora_b = _with_slot(_padded(layer.lora_b, rank, 1), slot, size,
                              None if b is None else _padded(b, rank, 0))
    layer.lora_scale = _with_slot(layer.lora_scale, slot, size, mx.array(scale, mx.float32))


def _lora_layers(model: nn.Module) -> dict[str, MultiLoRALinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, MultiLoRALinear)}


@dataclass
class AdapterSet:
    """The adapters attached to one model: slot ``i + 1`` is ``names[i]`` (None: a slot
    freed by ``remove``, zeros until ``add`` reuses it)."""

    names: list[str | None]
    rows: AdapterRows
    nbytes: int

    @classmethod
    def empty(cls) -> AdapterSet:
        """No adapters yet: the decoders still route rows, so ``add`` can attach one to a
        model whose requests are running."""
        return cls([], AdapterRows(0), 0)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (0 for None: the base model)."""
        if name is None:
            return 0
        try:
            return self.names.index(name) + 1
        except ValueError:
            raise AdapterError(f"adapter {name!r} is not loaded on this model") from None

    def add(self, model: nn.Module, name: str, info: AdapterInfo) -> None:
        """Attach one more adapter to ``model`` (between forwards: on the model's thread).
        Running rows keep their slots; everything is checked before the model changes."""
        if name in self.names:
            raise AdapterError(f"adapter {name!r} is already loaded on this model")
        layers = _lora_layers(model)
        modules = {p: layers[p].base if p in layers else m for p, m in model.named_modules()}
        factors = _load_weights({name: info}, modules)[name]
        slot = self.names.index(None) + 1 if None in self.names else len(self.names) + 1
        size = max(slot, len(self.names)) + 1
        fresh = []
        for path in sorted(set(layers) | set(factors)):
            layer = layers.get(path)
            if layer is None:  # a layer no adapter adapted before: wrap it, all zeros
                in_dims, out_dims = _linear_dims(modules[path]) or (0, 0)
                layer = MultiLoRALinear(modules[path], mx.zeros((1, in_dims, 1)),
                                        mx.zeros((1, 1, out_dims)), mx.zeros((1,)), self.rows)
                fresh.append((path, layer))
            _put(layer, slot, size, factors.get(path), info.scale)
        mx.eval([(layer.lora_a, layer.lora_b, layer.lora_scale)
                 for layer in [*layers.values(), *(f for _, f in fresh)]])
        if fresh:
            model.update_modules(tree_unflatten(fresh))
        if slot > len(self.names):
            self.names.append(name)
        else:
            self.names[slot - 1] = name
        self.rows.slots = len(self.names)
        self.nbytes = _stacked_nbytes(model)

    def remove(self, model: nn.Module, name: str) -> None:
        """Detach adapter ``name`` (no running row may use it): its slot becomes zeros, for
        ``add`` to reuse; freed slots at the end are dropped."""
        slot = self.slot(name)
        self.names[slot - 1] = None
        while self.names and self.names[-1] is None:
            self.names.pop()
        size = len(self.names) + 1
        layers = _lora_layers(model)
        for layer in layers.values():
            _put(layer, slot, max(size, slot + 1), None, 0.0)
            if layer.lora_a.shape[0] > size:
                layer.lora_a, layer.lora_b = layer.lora_a[:size], layer.lora_b[:size]
                layer.lora_scale = layer.lora_scale[:size]
        mx.eval([(layer.lora_a, layer.lora_b, layer.lora_scale) for layer in layers.values()])
        self.rows.slots = len(self.names)
        self.nbytes = _stacked_nbytes(model)


def _stacked_nbytes(model: nn.Module) -> int:
    return sum(layer.lora_a.nbytes + layer.lora_b.nbytes
               for layer in _lora_layers(model).values())


def _linear_dims(module: Any) -> tuple[int, int] | None:
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module.weight.shape
        return packed * 32 // module.bits, out
    if isinstance(module, nn.Linear):
        out, cols = module.weight.shape
        return cols, out
    return None


def _load_weights(adapters: Mapping[str, AdapterInfo],
                  modules: dict[str, Any]) -> dict[str, dict[str, tuple[mx.array, mx.array]]]:
    """Each adapter's factors by module path, checked against the loaded model."""
    loaded: dict[str, dict[str, tuple[mx.array, mx.array]]] = {}
    for name, info in adapters.items():
        weights = mx.load(str(info.weights))
        assert isinstance(weights, dict)
        layers: dict[str, tuple[mx.array, mx.array]] = {}
        for t in info.targets:
            dims = _linear_dims(modules.get(t.path))
            if dims is None:
                raise AdapterError(f"adapter {name!r} adapts {t.path}, which is not a linear "
                                   "layer of this model: it was trained for another model.")
            if dims != (t.in_dims, t.out_dims):
                raise AdapterError(f"adapter {name!r} adapts {t.path} as {t.in_dims} -> "
                                   f"{t.out_dims}; this model's is {dims[0]} -> {dims[1]}.")
            layers[t.path] = (weights[f"{t.path}.lora_a"], weights[f"{t.path}.lora_b"])
        loaded[name] = layers
    return loaded


def attach_adapters(model: nn.Module, adapters: Mapping[str, AdapterInfo]) -> AdapterSet:
    """Replace each targeted linear layer of ``model`` with a ``MultiLoRALinear`` holding
    every adapter's factors. Everything is checked before the model is changed."""
    modules = dict(model.named_modules())
    loaded = _load_weights(adapters, modules)
    names = list(adapters)
    rows = AdapterRows(len(names))
    rank = max(info.rank for info in adapters.values())
    paths = sorted({p for layers in loaded.values() for p in layers})
    dtype = mx.float32
    scales = mx.array([0.0] + [adapters[n].scale for n in names], dtype=mx.float32)
    replaced = []
    for path in paths:
        in_dims, out_dims = _linear_dims(modules[path]) or (0, 0)
        a_rows, b_rows = [mx.zeros((in_dims, rank), dtype)], [mx.zeros((rank, out_dims), dtype)]
        for n in names:
            a, b = loaded[n].get(path, (None, None))
            if a is None or b is None:
                a_rows.append(mx.zeros((in_dims, rank), dtype))
                b_rows.append(mx.zeros((rank, out_dims), dtype))
                continue
            pad = rank - a.shape[1]
            a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
            b_rows.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
        layer = MultiLoRALinear(modules[path], mx.stack(a_rows), mx.stack(b_rows), scales, rows)
        replaced.append((path, layer))
    mx.eval([layer.parameters() for _, layer in replaced])
    model.update_modules(tree_unflatten(replaced))
    return AdapterSet(list[str | None](names), rows, _stacked_nbytes(model))


class _RowsModel:
    """The model as one batch calls it: each forward runs with that batch's rows."""

    def __init__(self, model: Any, rows: AdapterRows, batch: Any) -> None:
        self._model, self._rows, self._batch = model, rows, batch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._rows.rows(self._batch.uids):
            return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _RowsPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, naming its rows around each forward (prefill, and the first
    decode step of the rows it hands to generation). ``adapter_rows`` is a class
    attribute of a per-model subclass, so the copies ``split`` makes keep it."""

    adapter_rows: AdapterRows

    def prompt(self, tokens: list[list[int]]) -> None:
        with self.adapter_rows.rows(self.uids):
            super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> Any:
        with self.adapter_rows.rows(list(self.uids)):
            return super().generate(tokens)


def route_rows(gen: BatchGenerator, rows: AdapterRows) -> None:
    """Make every forward ``gen`` runs name its rows to ``rows`` (before any sequence
    joins): the prompt batch by its class, the generation batch through its model."""
    batch_class: Any = type("RowsPromptBatch", (_RowsPromptBatch,), {"adapter_rows": rows})
    old = lm_internals.prompt_batch(gen)
    if len(old):
        raise RuntimeError("route adapter rows before the first sequence joins")
    lm_internals.replace_prompt_batch(
        gen, batch_class.empty(gen.model, gen.sampler, prefill_step_size=gen.prefill_step_size))
    generation = lm_internals.generation_batch(gen)
    generation.model = _RowsModel(generation.model, rows, generation)
