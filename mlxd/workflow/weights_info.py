"""What the weight files of a model say about it, read from headers only.

safetensors files start with a JSON header (names, dtypes, shapes); GGUF files
carry metadata and tensor descriptions before the data. Both are read here
without touching the weights, to count parameters, group tensor dtypes by the
role of the tensor (embeddings, attention, MLP, norms, ...) and spot
quantisation markers (MLX, GGUF types, GPTQ, AWQ, FP8, bitsandbytes).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.sources.gguf_header import GGUFHeader

# Tensor roles, tried in order; the first pattern that matches names the group.
_ROLES = (
    ("vision", re.compile(r"vision|visual|image|patch_embed|mm_projector|multi_modal")),
    ("audio", re.compile(r"audio|encoder\.conv|mel")),
    ("embeddings", re.compile(r"embed|wte|wpe|token_embd|word_embeddings|position_embeddings")),
    ("lm_head", re.compile(r"lm_head|^output\.")),
    ("norms", re.compile(r"norm|\bln|ln_|layernorm|LayerNorm")),
    ("attention", re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj|query|key|value")),
    ("mlp", re.compile(r"mlp|ffn|gate_proj|up_proj|down_proj|fc1|fc2|intermediate|"
                       r"output\.dense|experts")),
)
_QUANT_AUX = (".scales", ".biases", ".qzeros", ".g_idx", ".weight_scale", ".weight_scale_inv",
              ".input_scale", ".SCB", ".absmax", ".quant_map", ".quant_state")
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
                     "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                     "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1}


def tensor_role(name: str) -> str:
    """The role of a tensor from its name (``model.layers.3.mlp.up_proj.weight`` -> mlp)."""
    for role, pattern in _ROLES:
        if pattern.search(name):
            return role
    return "other"


@dataclass
class TensorSummary:
    """Parameters, per-role dtypes and quantisation markers of a set of weight files."""

    parameters: int = 0
    tensors: int = 0
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None
    file_format: str | None = None
    markers: list[str] = field(default_factory=list)

    def add(self, name: str, dtype: str, count: int = 1) -> None:
        group = self.dtypes.setdefault(tensor_role(name), {})
        group[dtype] = group.get(dtype, 0) + count
        self.tensors += 1

    def as_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "tensors": self.tensors,
                "dtypes": {k: dict(sorted(v.items())) for k, v in sorted(self.dtypes.items())},
                "quantization": self.quantization, "markers": sorted(set(self.markers))}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names -> dtype, shape, offsets)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise ValueError(f"{path.name}: implausible safetensors header size {size}")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: safetensors header is not a mapping")
    return header


def _quantized_bits(config: dict[str, Any]) -> int | None:
    q = config.get("quantization") or config.get("quantization_config") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    return int(bits) if isinstance(bits, int) and bits > 0 else None


def quantization_from_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """MLX (``quantization``) or Hugging Face (``quantization_config``) settings."""
    mlx_q = config.get("quantization")
    if isinstance(mlx_q, dict) and ("bits" in mlx_q or "group_size" in mlx_q):
        return {"method": f"mlx-{mlx_q.get('mode', 'affine')}", "bits": mlx_q.get("bits"),
                "group_size": mlx_q.get("group_size")}
    hf_q = config.get("quantization_config")
    if isinstance(hf_q, dict):
        method = str(hf_q.get("quant_method") or hf_q.get("quant_type") or "unknown").lower()
        if hf_q.get("load_in_4bit") or hf_q.get("load_in_8bit"):
            method = "bitsandbytes"
        return {"method": method, "bits": hf_q.get("bits") or hf_q.get("w_bit"),
                "group_size": hf_q.get("group_size") or hf_q.get("q_group_size"),
                "fmt": hf_q.get("fmt")}
    return None


def summarize_safetensors(files: list[Path], config: dict[str, Any]) -> TensorSummary:
    """Parameters and dtypes of safetensors files; packed quantised weights are unpacked."""
    summary = TensorSummary(quantization=quantization_from_config(config))
    bits = _quantized_bits(config)
    formats = set()
    for path in files:
        header = read_safetensors_header(path)
        meta = header.pop("__metadata__", None) or {}
        formats.add(str(meta.get("format") or "unknown"))
        names = set(header)
        for name, info in header.items():
            dtype, shape = str(info.get("dtype")), [int(x) for x in info.get("shape") or []]
            summary.add(name, dtype)
            if name.endswith(_QUANT_AUX):
                summary.markers.append(f"quantisation tensors ({name.rsplit('.', 1)[-1]})")
                continue
            count = 1
            for s in shape:
                count *= s
            stem = name.rsplit(".", 1)[0]
            packed = dtype in ("U32", "I32") and (
                f"{stem}.scales" in names or name.endswith(".qweight"))
            if packed and bits:
                count = count * 32 // bits
            if dtype.startswith("F8"):
                summary.markers.append("fp8 weights")
            if name.endswith(".qweight"):
                summary.markers.append("gptq/awq packed weights (qweight)")
            summary.parameters += count
    summary.file_format = "mlx" if formats == {"mlx"} else ",".join(sorted(formats)) or None
    if summary.quantization is None and "fp8 weights" in summary.markers:
        summary.quantization = {"method": "fp8"}
    return summary


def summarize_gguf(g: GGUFHeader) -> TensorSummary:
    """Parameters and GGUF tensor types per tensor group."""
    import gguf

    summary = TensorSummary(file_format="gguf")
    for t in g.tensors:
        summary.add(t.name, t.type_name)
        summary.parameters += t.n_elements
    file_type = g.metadata.get("general.file_type")
    try:
        ftype = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") \
            if file_type is not None else None
    except ValueError:
        ftype = str(file_type)
    summary.quantization = {"method": "gguf", "file_type": ftype, "types": g.type_counts()}
    return summary


def gguf_metadata(g: GGUFHeader) -> dict[str, Any]:
    """Architecture, context, tokenizer and template facts from GGUF metadata."""
    meta = g.metadata
    return {
        "architecture": g.arch or None,
        "name": meta.get("general.name"),
        "context_length": g.a("context_length"),
        "layers": g.a("block_count"),
        "hidden_size": g.a("embedding_length"),
        "heads": g.a("attention.head_count"),
        "kv_heads": g.a("attention.head_count_kv"),
        "chat_template": bool(meta.get("tokenizer.chat_template")),
        "tokenizer": {"type": meta.get("tokenizer.ggml.model"),
                      "pre": meta.get("tokenizer.ggml.pre"),
                      "vocab_size": g.array_lengths.get("tokenizer.ggml.tokens")},
        "license": meta.get("general.license"),
    }


def tokenizer_facts(folder: Path) -> dict[str, Any] | None:
    """Type, class and vocabulary size of a Hugging Face tokenizer folder."""
    facts: dict[str, Any] = {}
    tok_json = folder / "tokenizer.json"
    if tok_json.is_file():
        try:
            data = json.loads(tok_json.read_text(encoding="utf-8"))
            model = data.get("model") or {}
            facts["type"] = model.get("type")
            vocab = model.get("vocab")
            facts["vocab_size"] = (len(vocab) if isinstance(vocab, (dict, list)) else None)
            if facts["vocab_size"] is not None:
                facts["vocab_size"] += len(data.get("added_tokens") or [])
        except (OSError, ValueError):
            facts["type"] = "unreadable tokenizer.json"
    if (folder / "tokenizer.model").is_file():
        facts.setdefault("type", "SentencePiece")
    if (folder / "vocab.txt").is_file():
        facts.setdefault("type", "WordPiece")
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            facts["class"] = cfg.get("tokenizer_class")
        except (OSError, ValueError):
            pass
    return facts or None


def has_chat_template(folder: Path) -> bool:
    """Whether a Hugging Face folder ships a chat template (any of the usual places)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    cfg_path = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False


def sub_configs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Short summaries of the nested text / vision / audio configs."""
    out: dict[str, dict[str, Any]] = {}
    for key in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        sub = config.get(key)
        if isinstance(sub, dict):
            out[key.removesuffix("_config")] = {
                k: sub[k] for k in ("model_type", "hidden_size", "num_hidden_layers",
                                    "num_attention_heads", "image_size", "patch_size",
                                    "num_mel_bins") if k in sub}
    return out
