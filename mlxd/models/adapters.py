"""LoRA adapters in mlx-lm's format, read and checked against their base model.

``mlx_lm.lora --train`` writes a folder with ``adapters.safetensors`` (for each
adapted linear layer ``P``: ``P.lora_a`` of shape (in, rank) and ``P.lora_b`` of
shape (rank, out)) and ``adapter_config.json`` (``fine_tune_type``, ``num_layers``,
``lora_parameters`` {rank, scale, dropout, keys}). ``read_adapter`` checks all of
it from the files' headers (no weights are read, no MLX is needed), against the
base model's ``config.json`` and safetensors headers when the base folder is
given, so a bad adapter is refused before anything is registered or loaded.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_HEADER = 100 * 1024 * 1024


class AdapterError(ValueError):
    """An adapter folder that cannot be served (on its own or over this base model)."""


@dataclass(frozen=True)
class AdapterTarget:
    """One adapted linear layer: its module path and dimensions."""

    path: str  # e.g. ``model.layers.3.self_attn.q_proj``
    in_dims: int
    out_dims: int


@dataclass(frozen=True)
class AdapterInfo:
    """A checked mlx-lm LoRA adapter folder."""

    folder: Path
    rank: int
    scale: float
    num_layers: int
    targets: tuple[AdapterTarget, ...]
    nbytes: int  # the weights file's size: what the adapter adds to the budget

    @property
    def weights(self) -> Path:
        return self.folder / WEIGHTS_FILE


def stacked_nbytes(infos: list[AdapterInfo], dtype_bytes: int = 4) -> int:
    """What serving ``infos`` together over one base holds: every adapted layer stacks
    one slot per adapter plus the base's (zeros), each padded to the largest rank."""
    if not infos:
        return 0
    rank = max(i.rank for i in infos)
    layers = {t.path: t.in_dims + t.out_dims for i in infos for t in i.targets}
    return (len(infos) + 1) * rank * sum(layers.values()) * dtype_bytes


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header without ``__metadata__``, and where its data starts (the
    data is not read)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{path} is not a safetensors file (too short).")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise AdapterError(f"{path} is not a safetensors file (header of {size} bytes).")
            header = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} cannot be read as safetensors: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a safetensors file.")
    header.pop("__metadata__", None)
    return header, 8 + size


def safetensors_shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, dtype)}`` from a safetensors file's header (its data is not read)."""
    header, _ = safetensors_header(path)
    return {k: (list(v["shape"]), str(v["dtype"])) for k, v in header.items()
            if isinstance(v, dict) and "shape" in v}


def adapter_config(folder: Path) -> dict[str, Any]:
    """An adapter folder's ``adapter_config.json`` (mlx-lm's or PEFT's), a JSON object."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object.")
    return config


def _config(folder: Path) -> dict[str, Any]:
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: not an mlx-lm adapter folder "
                           "(mlx_lm.lora --train writes one next to adapters.safetensors).")
    return adapter_config(folder)


def _lora_parameters(config: dict[str, Any], folder: Path) -> tuple[int, float, int]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{folder}: fine_tune_type {kind!r} is not served; only 'lora' "
                           "adapters are (fuse a DoRA or full fine-tune into a model instead).")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{folder}/{CONFIG_FILE} has no lora_parameters object.")
    rank, scale, layers = params.get("rank"), params.get("scale"), config.get("num_layers")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{folder}: lora_parameters.rank must be a positive integer, "
                           f"got {rank!r}.")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != scale:
        raise AdapterError(f"{folder}: lora_parameters.scale must be a number, got {scale!r}.")
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise AdapterError(f"{folder}: num_layers must be an integer, got {layers!r}.")
    return rank, float(scale), layers


def _targets(shapes: dict[str, tuple[list[int], str]], rank: int,
             folder: Path) -> list[AdapterTarget]:
    names = set(shapes)
    stray = sorted(n for n in names if not n.endswith((".lora_a", ".lora_b")))
    if stray:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds {stray[0]!r}, not a LoRA weight "
                           "(lora_a/lora_b only).")
    out: list[AdapterTarget] = []
    for a in sorted(n for n in names if n.endswith(".lora_a")):
        path = a[: -len(".lora_a")]
        b = path + ".lora_b"
        if b not in shapes:
            raise AdapterError(f"{folder}: {path} has lora_a but no lora_b.")
        (sa, _), (sb, _) = shapes[a], shapes[b]
        if len(sa) != 2 or len(sb) != 2 or sa[1] != rank or sb[0] != rank:
            raise AdapterError(f"{folder}: {path} has lora_a {sa} and lora_b {sb}; rank {rank} "
                               "(adapter_config.json) needs (in, rank) and (rank, out).")
        out.append(AdapterTarget(path, sa[0], sb[1]))
    orphans = sorted(n[: -len(".lora_b")] for n in names if n.endswith(".lora_b")
                     and n[: -len(".lora_b")] + ".lora_a" not in names)
    if orphans:
        raise AdapterError(f"{folder}: {orphans[0]} has lora_b but no lora_a.")
    if not out:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights.")
    return out


def base_linear_shapes(base: Path) -> dict[str, tuple[int, int]]:
    """``{module path: (in, out)}`` of the base model's linear weights, from its headers."""
    config = json.loads((base / "config.json").read_text())
    bits = (config.get("quantization") or {}).get("bits")
    bits = bits if isinstance(bits, int) and bits > 0 else 0
    shapes: dict[str, list[int]] = {}
    for file in sorted(base.glob("*.safetensors")):
        shapes.update((k, v[0]) for k, v in safetensors_shapes(file).items())
    dims: dict[str, tuple[int, int]] = {}
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2:
            module = name[: -len(".weight")]
            packed = bits and f"{module}.scales" in shapes
            dims[module] = (shape[1] * 32 // bits if packed else shape[1], shape[0])
    return dims


def base_layer_count(base: Path) -> int | None:
    config = json.loads((base / "config.json").read_text())
    text = config.get("text_config") or {}
    value = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    return value if isinstance(value, int) else None


def read_adapter(folder: Path, base: Path | None = None) -> AdapterInfo:
    """The adapter in ``folder``, checked; with ``base`` (a local model folder), checked
    to fit it: every adapted layer exists in the base with the adapter's shapes, and
    ``num_layers`` does not exceed the base's layers. Raises ``AdapterError``."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"Adapter folder {folder} does not exist.")
    rank, scale, num_layers = _lora_parameters(_config(folder), folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE} (mlx_lm.lora --train writes it).")
    targets = _targets(safetensors_shapes(weights), rank, folder)
    if base is not None and (base / "config.json").is_file():
        check_fits(targets, num_layers, base, folder)
    return AdapterInfo(folder, rank, scale, num_layers, tuple(targets), weights.stat().st_size)


def check_fits(targets: list[AdapterTarget], num_layers: int, base: Path, folder: Path) -> None:
    layers = base_layer_count(base)
    if layers is not None and num_layers > layers:
        raise AdapterError(f"{folder} adapts {num_layers} layers; the base model {base.name} "
                           f"has {layers}: the adapter was trained for another model.")
    linear = base_linear_shapes(base)
    for t in targets:
        m = _LAYER.search(t.path)
        if layers is not None and m and int(m.group(1)) >= layers:
            raise AdapterError(f"{folder} adapts {t.path}; the base model {base.name} has "
                               f"{layers} layers: the adapter was trained for another model.")
        if layers is not None and m and int(m.group(1)) < layers - num_layers:
            raise AdapterError(f"{folder} adapts {t.path}, outside its last {num_layers} "
                               f"layers of {layers} (num_layers in {CONFIG_FILE}): mlx-lm "
                               "would not attach it.")
        if t.path not in linear:
            raise AdapterError(f"{folder} adapts {t.path}, which the base model {base.name} "
                               "does not have: the adapter was trained for another architecture.")
        if linear[t.path] != (t.in_dims, t.out_dims):
            raise AdapterError(
                f"{folder} adapts {t.path} as {t.in_dims} -> {t.out_dims}; in the base model "
                f"{base.name} it is {linear[t.path][0]} -> {linear[t.path][1]}: the adapter was "
                "trained for another model.")
