"""Hugging Face PEFT LoRA adapters, read and rewritten in mlx-lm's adapter format.

PEFT saves ``adapter_model.safetensors`` with, for each adapted linear layer ``P``,
``base_model.model.P.lora_A.weight`` of shape (rank, in) and ``...lora_B.weight`` of
shape (out, rank), and ``adapter_config.json`` with ``r``, ``lora_alpha``,
``target_modules`` and ``base_model_name_or_path``. PEFT computes
``W x + (alpha / r) * B (A x)``; mlx-lm's ``LoRALinear`` computes
``W x + scale * (x @ lora_a) @ lora_b``, so ``lora_a = A.T``, ``lora_b = B.T`` and
``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). mlx-lm adapts the last
``num_layers`` layers, so ``num_layers`` runs from the first adapted layer to the
base model's last one. No torch or peft is needed: the files are safetensors + JSON.

What mlx-lm's format cannot say is refused with the reason: DoRA (PEFT's
``lora_magnitude_vector``), per-module ranks or alphas, embedding LoRA, biases,
``modules_to_save`` (full weights), Conv1D layouts (``fan_in_fan_out``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.models.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    adapter_config,
    safetensors_header,
)

PEFT_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def is_peft_adapter(folder: Path) -> bool:
    """Whether ``folder`` looks like a PEFT adapter (its weights file and a PEFT config)."""
    if not (folder / PEFT_WEIGHTS).is_file() or not (folder / CONFIG_FILE).is_file():
        return False
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True  # read_peft says what is wrong with it
    return isinstance(config, dict) and ("peft_type" in config or "lora_alpha" in config)


@dataclass
class PeftAdapter:
    """A checked PEFT LoRA folder: what it adapts, and the mlx-lm scale it maps to."""

    folder: Path
    rank: int
    alpha: float
    scale: float
    base: str | None  # base_model_name_or_path
    keys: list[str]  # module names under a layer, e.g. self_attn.q_proj
    layers: list[int]  # indices of the adapted layers
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (in, out)
    dtypes: list[str] = field(default_factory=list)

    def num_layers(self, base_layers: int | None) -> int:
        """mlx-lm's ``num_layers``: from the first adapted layer to the base's last one."""
        top = base_layers if base_layers is not None else max(self.layers) + 1
        return top - min(self.layers)

    def facts(self) -> dict[str, Any]:
        return {"format": "peft", "fine_tune_type": "lora", "rank": self.rank,
                "lora_alpha": self.alpha, "scale": self.scale, "base": self.base,
                "targets": self.keys, "layers": len(self.layers),
                "layer_range": [min(self.layers), max(self.layers)],
                "dtypes": self.dtypes}


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 numpy (F32, F16, BF16, F64)."""
    header, start = safetensors_header(path)
    data = path.read_bytes()[start:]
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        dtype = _DTYPES.get(str(meta.get("dtype")))
        if dtype is None:
            raise AdapterError(f"{path}: tensor {name} has dtype {meta.get('dtype')}; "
                               f"LoRA factors must be one of {', '.join(_DTYPES)}.")
        lo, hi = meta["data_offsets"]
        shape = [int(d) for d in meta["shape"]]
        raw = np.frombuffer(data[lo:hi], dtype=dtype)
        if raw.size != math.prod(shape) or hi > len(data):
            raise AdapterError(f"{path}: tensor {name} is truncated or its shape {shape} "
                               "does not match its bytes.")
        if meta["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(shape)
    return out


def _refuse_unsupported(config: dict[str, Any], folder: Path) -> None:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{folder}: PEFT type {kind} is not LoRA; only LoRA adapters convert "
                           "to mlx-lm's format.")
    reasons = {
        "use_dora": "it is DoRA (mlx-lm's DoRA keeps its magnitudes per layer in another form)",
        "fan_in_fan_out": "its layers are Conv1D (fan_in_fan_out), not nn.Linear",
        "modules_to_save": "it also saves full modules (modules_to_save)",
        "rank_pattern": "its ranks differ per module (rank_pattern)",
        "alpha_pattern": "its alphas differ per module (alpha_pattern)",
    }
    for key, why in reasons.items():
        if config.get(key):
            raise AdapterError(f"{folder}: cannot convert this PEFT adapter: {why}; mlx-lm's "
                               "format has one rank and scale for plain LoRA layers.")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: cannot convert this PEFT adapter: it trains biases "
                           f"(bias={config.get('bias')!r}); mlx-lm's LoRA format has none.")


def _number(config: dict[str, Any], key: str, folder: Path, *, integer: bool) -> float:
    value = config.get(key)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not value > 0 or not math.isfinite(value):
        raise AdapterError(f"{folder}/{CONFIG_FILE}: {key} must be a positive "
                           f"{'integer' if integer else 'number'}, got {value!r}.")
    return float(value)


def read_peft(folder: Path) -> PeftAdapter:
    """The PEFT adapter in ``folder``, checked from its config and safetensors header."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"Adapter folder {folder} does not exist.")
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder.")
    config = adapter_config(folder)
    _refuse_unsupported(config, folder)
    rank = int(_number(config, "r", folder, integer=True))
    alpha = _number(config, "lora_alpha", folder, integer=False)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = folder / PEFT_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{folder} has no {PEFT_WEIGHTS} (PEFT's save_pretrained writes it;"
                           " a PyTorch adapter_model.bin must be saved as safetensors first).")
    header, _ = safetensors_header(weights)
    targets = config.get("target_modules")
    named = set(targets) if isinstance(targets, list) else None
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, meta in header.items():
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(f"{folder}: {PEFT_WEIGHTS} holds {name!r}, not a LoRA factor of "
                               "a linear layer (base_model.model.<module>.lora_A/B.weight).")
        pairs.setdefault(m["path"], {})[m["ab"]] = [int(d) for d in meta["shape"]]
    if not pairs:
        raise AdapterError(f"{folder}: {PEFT_WEIGHTS} holds no LoRA weights.")
    shapes: dict[str, tuple[int, int]] = {}
    keys, layers = set(), set()
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {path} has lora_{next(iter(ab))} but not "
                               f"lora_{'B' if 'A' in ab else 'A'}.")
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(f"{folder}: {path} has lora_A {a} and lora_B {b}; r = {rank} "
                               "(adapter_config.json) needs (r, in) and (out, r).")
        m = _LAYER.search(path)
        if m is None:
            raise AdapterError(f"{folder}: {path} is not inside a transformer layer "
                               "(model.layers.N...); mlx-lm adapts layers only.")
        if named is not None and path.rsplit(".", 1)[-1] not in named:
            raise AdapterError(f"{folder}: {path} is adapted but target_modules "
                               f"{sorted(named)} does not name it.")
        layers.add(int(m.group(1)))
        keys.add(m.group(2))
        shapes[path] = (a[1], b[0])
    base = config.get("base_model_name_or_path")
    return PeftAdapter(folder, rank, alpha, scale, base if isinstance(base, str) else None,
                       sorted(keys), sorted(layers), shapes,
                       sorted({str(v.get("dtype")) for v in header.values()}))


def write_mlx_adapter(peft: PeftAdapter, out: Path, *, base_layers: int | None) -> dict[str, Any]:
    """Write ``peft`` into the folder ``out`` in mlx-lm's format (float32 factors);
    returns what was written, for the conversion manifest."""
    from safetensors.numpy import save_file

    tensors = read_tensors(peft.folder / PEFT_WEIGHTS)
    weights: dict[str, np.ndarray] = {}
    for path in peft.shapes:
        a = tensors[f"base_model.model.{path}.lora_A.weight"]
        b = tensors[f"base_model.model.{path}.lora_B.weight"]
        weights[f"{path}.lora_a"] = np.ascontiguousarray(a.T)
        weights[f"{path}.lora_b"] = np.ascontiguousarray(b.T)
    num_layers = peft.num_layers(base_layers)
    if num_layers < 1:
        raise AdapterError(f"{peft.folder} adapts layer {max(peft.layers)}; the base model has "
                           f"{base_layers} layers: the adapter was trained for another model.")
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "mlx"})
    config = {"fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": peft.rank, "scale": peft.scale, "dropout": 0.0,
                                  "keys": peft.keys},
              "model": peft.base, "converted_from": "peft"}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=4))
    return {"num_layers": num_layers, "rank": peft.rank, "scale": peft.scale,
            "keys": peft.keys, "tensors": len(weights), "layers_assumed_to_end":
            base_layers is None}
