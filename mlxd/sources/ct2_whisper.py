"""CTranslate2 Whisper (``model.bin``) -> an mlx-whisper folder.

``model.bin`` (binary version 5 or 6) is a header (spec name, revision), then
per variable its name, rank, dims, dtype and raw bytes, then aliases. Whisper's
fused projections are split back: self-attention ``linear_0`` holds Q, K, V
(the key projection has no bias; CTranslate2 stores zeros) and cross-attention
``linear_1`` holds K, V. Conv weights go from (out, in, k) to MLX's (out, k, in).
The output is ``weights.safetensors`` + ``config.json`` (ModelDimensions) that
``mlx_whisper.load_models.load_model(folder)`` loads; no ctranslate2 needed.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.jsonfile import read_json_object
from mlxd.sources.staging import staged_folder

SUPPORTED_VERSIONS = (5, 6)
_DTYPES: dict[int, Any] = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16,
                           5: "bfloat16"}
_DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
COPIED_FILES = ("tokenizer.json", "vocabulary.txt", "vocabulary.json", "preprocessor_config.json")
ProgressFn = Callable[[int, int, str], None]


def is_ctranslate2_whisper(folder: Path) -> bool:
    """A CTranslate2 Whisper folder: ``model.bin`` beside a config with Whisper's keys."""
    if not (folder / "model.bin").is_file():
        return False
    cfg = read_json_object(folder / "config.json")
    return "alignment_heads" in cfg or "suppress_ids" in cfg or "lang_ids" in cfg


class CT2Error(ValueError):
    """The folder is not a CTranslate2 Whisper model this converter reads."""


@dataclass
class CT2Variable:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass
class CT2Model:
    """The header of a CTranslate2 ``model.bin`` and lazy access to its variables."""

    path: Path
    version: int
    spec: str
    revision: int
    variables: dict[str, CT2Variable] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def array(self, name: str) -> np.ndarray:
        """One variable as a float32 numpy array (int8 weights are de-scaled)."""
        var = self.variables[self.aliases.get(name, name)]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=var.offset,
                        shape=(var.nbytes,))
        code = next(k for k, v in _DTYPE_NAMES.items() if v == var.dtype)
        if var.dtype == "bfloat16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, _DTYPES[code]).astype(np.float32)
        arr = arr.reshape(var.shape) if var.shape else arr.reshape(())
        scale_name = f"{name}_scale"
        if var.dtype == "int8" and scale_name in self.variables:
            scale = self.array(scale_name)  # CTranslate2 int8: q = w * scale (per row)
            arr = arr / scale.reshape(-1, *([1] * (arr.ndim - 1)))
        return arr

    def scalar(self, name: str) -> int:
        return int(self.array(name).reshape(-1)[0])

    def parameter_count(self) -> int:
        return int(sum(int(np.prod(v.shape)) for v in self.variables.values()
                       if len(v.shape) > 0 and not v.name.endswith("_scale")))

    def dtypes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.variables.values():
            if v.shape:
                out[v.dtype] = out.get(v.dtype, 0) + 1
        return out


def read_ct2(path: Path) -> CT2Model:
    """Read the header of a CTranslate2 ``model.bin`` (variables stay on disk)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _read_header(fh, path)
    except (struct.error, UnicodeDecodeError, KeyError) as e:
        raise CT2Error(f"{path} is not a readable CTranslate2 model.bin ({e})") from None


def _read_header(fh: Any, path: Path) -> CT2Model:
    def unpack(fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, fh.read(size))

    def string() -> str:
        (n,) = unpack("H")
        return bytes(fh.read(n)).rstrip(b"\0").decode("utf-8")

    (version,) = unpack("I")
    if version not in SUPPORTED_VERSIONS:
        raise CT2Error(f"{path}: CTranslate2 binary version {version} is not supported "
                       f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    model = CT2Model(path, version, string(), unpack("I")[0])
    (count,) = unpack("I")
    for _ in range(count):
        name = string()
        (rank,) = unpack("B")
        dims = tuple(int(d) for d in unpack("I" * rank)) if rank else ()
        (code,) = unpack("B")
        (nbytes,) = unpack("I")
        if code not in _DTYPE_NAMES:
            raise CT2Error(f"{path}: variable {name} has unsupported dtype code {code}")
        model.variables[name] = CT2Variable(name, dims, _DTYPE_NAMES[code], fh.tell(), nbytes)
        fh.seek(nbytes, 1)
    (n_aliases,) = unpack("I")
    for _ in range(n_aliases):
        alias = string()
        model.aliases[alias] = string()
    return model


def _layers(model: CT2Model, prefix: str) -> int:
    found = {m.group(1) for m in (re.match(rf"{prefix}/layer_(\d+)/", k)
                                  for k in model.variables) if m}
    return len(found)


def whisper_dims(model: CT2Model) -> dict[str, int]:
    """mlx-whisper ``ModelDimensions`` of a CTranslate2 Whisper model."""
    if model.spec != "WhisperSpec":
        raise CT2Error(f"{model.path}: spec {model.spec!r} is not WhisperSpec; only "
                       "CTranslate2 Whisper models are supported")
    v = model.variables
    state = v["encoder/conv1/weight"].shape[0]
    return {
        "n_mels": v["encoder/conv1/weight"].shape[1],
        "n_audio_ctx": v["encoder/position_encodings/encodings"].shape[0],
        "n_audio_state": state,
        "n_audio_head": model.scalar("encoder/num_heads"),
        "n_audio_layer": _layers(model, "encoder"),
        "n_vocab": v["decoder/embeddings/weight"].shape[0],
        "n_text_ctx": v["decoder/position_encodings/encodings"].shape[0],
        "n_text_state": v["decoder/embeddings/weight"].shape[1],
        "n_text_head": model.scalar("decoder/num_heads"),
        "n_text_layer": _layers(model, "decoder"),
    }


class _WeightMap:
    """Collects mlx-whisper weights from CTranslate2 variables."""

    def __init__(self, model: CT2Model) -> None:
        self.model = model
        self.out: dict[str, np.ndarray] = {}

    def norm(self, dst: str, src: str) -> None:
        self.out[f"{dst}.weight"] = self.model.array(f"{src}/gamma")
        self.out[f"{dst}.bias"] = self.model.array(f"{src}/beta")

    def linear(self, dst: str, src: str, bias: bool = True) -> None:
        self.out[f"{dst}.weight"] = self.model.array(f"{src}/weight")
        if bias:
            self.out[f"{dst}.bias"] = self.model.array(f"{src}/bias")

    def fused(self, dst: str, src: str, parts: tuple[str, ...]) -> None:
        """Split a fused projection; ``key`` gets no bias (Whisper's has none)."""
        weights = np.split(self.model.array(f"{src}/weight"), len(parts))
        biases = np.split(self.model.array(f"{src}/bias"), len(parts))
        for part, w, b in zip(parts, weights, biases):
            self.out[f"{dst}.{part}.weight"] = w
            if part != "key":
                self.out[f"{dst}.{part}.bias"] = b

    def block(self, dst: str, src: str, cross: bool) -> None:
        self.fused(f"{dst}.attn", f"{src}/self_attention/linear_0", ("query", "key", "value"))
        self.linear(f"{dst}.attn.out", f"{src}/self_attention/linear_1")
        self.norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
        if cross:
            self.linear(f"{dst}.cross_attn.query", f"{src}/attention/linear_0")
            self.fused(f"{dst}.cross_attn", f"{src}/attention/linear_1", ("key", "value"))
            self.linear(f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
            self.norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
        self.linear(f"{dst}.mlp1", f"{src}/ffn/linear_0")
        self.linear(f"{dst}.mlp2", f"{src}/ffn/linear_1")
        self.norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")


def whisper_weights(model: CT2Model, dims: dict[str, int],
                    progress: ProgressFn | None = None) -> dict[str, np.ndarray]:
    """All mlx-whisper weights (float32 numpy) of a CTranslate2 Whisper model."""
    w = _WeightMap(model)
    for conv in ("conv1", "conv2"):
        w.out[f"encoder.{conv}.weight"] = model.array(f"encoder/{conv}/weight").transpose(0, 2, 1)
        w.out[f"encoder.{conv}.bias"] = model.array(f"encoder/{conv}/bias")
    total = dims["n_audio_layer"] + dims["n_text_layer"]
    for i in range(dims["n_audio_layer"]):
        w.block(f"encoder.blocks.{i}", f"encoder/layer_{i}", cross=False)
        if progress:
            progress(i + 1, total, f"encoder layer {i}")
    w.norm("encoder.ln_post", "encoder/layer_norm")
    w.out["decoder.token_embedding.weight"] = model.array("decoder/embeddings/weight")
    w.out["decoder.positional_embedding"] = model.array("decoder/position_encodings/encodings")
    for i in range(dims["n_text_layer"]):
        w.block(f"decoder.blocks.{i}", f"decoder/layer_{i}", cross=True)
        if progress:
            progress(dims["n_audio_layer"] + i + 1, total, f"decoder layer {i}")
    w.norm("decoder.ln", "decoder/layer_norm")
    return w.out


@dataclass
class WhisperConversion:
    output: Path
    dims: dict[str, int]
    tensors: int
    parameters: int
    dtype: str
    seconds: float
    source_dtypes: dict[str, int]


def write_whisper_folder(src: Path, folder: Path, *, dtype: str = "float16",
                         progress: ProgressFn | None = None) -> WhisperConversion:
    """Write the mlx-whisper files of the CTranslate2 folder ``src`` into ``folder``."""
    from safetensors.numpy import save_file

    t0 = time.monotonic()
    if dtype not in ("float16", "float32"):
        raise CT2Error(f"dtype {dtype!r} is not supported for Whisper; use float16 or float32")
    src = Path(src)
    if not (src / "model.bin").is_file():
        raise CT2Error(f"{src} has no model.bin (expected a CTranslate2 Whisper folder)")
    model = read_ct2(src / "model.bin")
    dims = whisper_dims(model)
    weights = whisper_weights(model, dims, progress)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    weights = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in weights.items()}
    save_file(weights, str(folder / "weights.safetensors"), metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({**dims, "model_type": "whisper"}, indent=2))
    ct2_cfg = read_json_object(src / "config.json")
    if ct2_cfg.get("alignment_heads") is not None:
        (folder / "alignment_heads.json").write_text(json.dumps(ct2_cfg["alignment_heads"]))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
    for p in folder.iterdir():
        p.chmod(0o644)
    params = int(sum(v.size for v in weights.values()))
    return WhisperConversion(Path(folder), dims, len(weights), params, dtype,
                             time.monotonic() - t0, model.dtypes())


def convert_ct2_whisper(src: Path, out: Path, *, dtype: str = "float16", force: bool = False,
                        progress: ProgressFn | None = None) -> WhisperConversion:
    """Convert a CTranslate2 Whisper folder into an mlx-whisper folder at ``out`` (atomically)."""
    with staged_folder(out, force=force) as staging:
        result = write_whisper_folder(src, staging, dtype=dtype, progress=progress)
    result.output = Path(out)
    return result


