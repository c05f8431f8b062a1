"""GGUF -> MLX conversion for the llama, qwen2, qwen3 and gemma3 families.

Tensors are dequantised with the ``gguf`` package (numpy; no torch, no
llama.cpp), renamed to the Hugging Face layout mlx-lm loads, and written with a
``config.json`` built from the GGUF metadata and a tokenizer rebuilt from the
GGUF vocabulary. Facts that matter:

* GGUF stores shapes reversed (``ne``), so arrays are reshaped reversed.
* llama.cpp permutes the rows of Q and K of llama-architecture models for its
  RoPE layout; ``unpermute_qk`` undoes it (without it the model talks nonsense).
* llama.cpp stores Gemma RMSNorm weights as ``1 + w``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
ProgressFn = Callable[[int, int, str], None]


class ConversionError(ValueError):
    """The input cannot be converted; the message says what is supported."""


@dataclass
class ConversionResult:
    output: Path
    architecture: str
    tensors: int
    parameters: int
    dtype: str
    seconds: float
    source_quantization: dict[str, int] = field(default_factory=dict)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of Q/K rows (per head: interleaved -> halves)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}
_NORM_NAMES = {
    # llama/qwen: one norm before attention, one before the MLP
    "default": {"ffn_norm": "post_attention_layernorm"},
    # gemma3: sandwich norms
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to the mlx-lm/HF name."""
    parts = gguf_name.split(".")
    if parts[0] in _GLOBAL_NAMES:
        return ".".join([_GLOBAL_NAMES[parts[0]], *parts[1:]])
    if parts[0] != "blk" or len(parts) < 4:
        raise ConversionError(f"unexpected tensor {gguf_name!r}")
    layer, kind, suffix = parts[1], parts[2], ".".join(parts[3:])
    names = {**_LAYER_NAMES, **_NORM_NAMES.get(arch, _NORM_NAMES["default"])}
    if kind not in names:
        raise ConversionError(f"tensor {gguf_name!r} has no mapping for architecture {arch}")
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


class GGUFModel:
    """Read access to a GGUF file's metadata and tensors."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:
            raise ConversionError(f"{path} is not a readable GGUF file: {e}") from e
        self.arch = str(self.get("general.architecture") or "")

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:
            return default

    def a(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    @property
    def tensors(self) -> list[Any]:
        return list(self.reader.tensors)

    def quantization_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.reader.tensors:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    def parameter_count(self) -> int:
        return int(sum(int(np.prod([int(x) for x in t.shape])) for t in self.reader.tensors))

    def vocab_size(self) -> int:
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        return int(self.a("vocab_size") or (len(tokens.data) if tokens is not None else 0))


def build_config(g: GGUFModel, has_lm_head: bool, dtype: str) -> dict[str, Any]:
    arch = g.arch
    heads = int(g.a("attention.head_count"))
    common: dict[str, Any] = dict(
        hidden_size=int(g.a("embedding_length")),
        intermediate_size=int(g.a("feed_forward_length")),
        num_hidden_layers=int(g.a("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(g.a("attention.head_count_kv") or heads),
        rms_norm_eps=float(g.a("attention.layer_norm_rms_epsilon") or 1e-6),
        rope_theta=float(g.a("rope.freq_base") or 10000.0),
        max_position_embeddings=int(g.a("context_length") or 4096),
        vocab_size=g.vocab_size(),
        tie_word_embeddings=not has_lm_head,
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=g.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"),
        torch_dtype=dtype,
    )
    key_length = g.a("attention.key_length")
    if arch == "llama":
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                    **common)
    if arch == "qwen2":
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                    **common)
    if arch == "qwen3":
        return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                    head_dim=int(key_length or common["hidden_size"] // heads), **common)
    if arch == "gemma3":
        layers = common["num_hidden_layers"]
        pattern = 6
        common.update(tie_word_embeddings=True)
        return dict(
            architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
            head_dim=int(key_length), query_pre_attn_scalar=int(key_length),
            rope_local_base_freq=10000.0, sliding_window=int(g.a("attention.sliding_window") or 512),
            sliding_window_pattern=pattern,
            layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                         for i in range(layers)],
            hidden_activation="gelu_pytorch_tanh", rope_scaling=None,
            final_logit_softcapping=None, attn_logit_softcapping=None, **common)
    raise ConversionError(f"GGUF architecture '{arch}' is not supported; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def convert_tensors(g: GGUFModel, dtype: str, *, permute: bool = True,
                    progress: ProgressFn | None = None) -> dict[str, np.ndarray]:
    import gguf

    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    heads = int(g.a("attention.head_count"))
    kv_heads = int(g.a("attention.head_count_kv") or heads)
    tensors = g.tensors
    out: dict[str, np.ndarray] = {}
    for i, t in enumerate(tensors):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed([int(s) for s in t.shape])])
        name = hf_tensor_name(t.name, g.arch)
        if permute and g.arch == "llama" and name.endswith("weight"):
            if ".self_attn.q_proj." in name:
                w = unpermute_qk(w, heads)
            elif ".self_attn.k_proj." in name:
                w = unpermute_qk(w, kv_heads)
        if g.arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0
        out[name] = np.ascontiguousarray(w.astype(np_dtype))
        if progress:
            progress(i + 1, len(tensors), t.name)
    return out


def _add_bos_eos(g: GGUFModel, backend: Any, tok: Callable[[str], str | None]) -> None:
    """Honour ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (Gemma needs its BOS)."""
    from tokenizers import processors

    marks = []
    for key, id_key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        text = tok(id_key)
        if g.get(f"tokenizer.ggml.{key}") and text is not None:
            marks.append((key, text, int(g.get(f"tokenizer.ggml.{id_key}"))))
    if not marks:
        return
    bos = [f"{t}:0" for k, t, _ in marks if k == "add_bos_token"]
    eos = [f"{t}:0" for k, t, _ in marks if k == "add_eos_token"]
    template = processors.TemplateProcessing(
        single=" ".join([*bos, "$A:0", *eos]),
        pair=" ".join([*bos, "$A:0", *eos, *[m.replace(":0", ":1") for m in bos], "$B:1",
                       *[m.replace(":0", ":1") for m in eos]]),
        special_tokens=sorted({(t, i) for _, t, i in marks}))
    current = backend.post_processor
    if current is None or isinstance(current, processors.TemplateProcessing):
        backend.post_processor = template
    else:  # e.g. ByteLevel offsets trimming: keep it, then add the special tokens
        backend.post_processor = processors.Sequence([current, template])


def build_tokenizer(g: GGUFModel) -> Any:
    """A ``PreTrainedTokenizerFast`` rebuilt from the GGUF vocabulary (no torch)."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    mapping = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tdict = {name: g.get("tokenizer." + key) for key, name in mapping.items()
             if ("tokenizer." + key) in g.reader.fields}
    if "tokens" not in tdict:
        raise ConversionError(f"{g.path.name} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    backend, extra = convert_gguf_tokenizer(g.arch, tdict)
    if g.get("tokenizer.ggml.pre") == "smollm":
        # SmolLM's tokenizer splits every digit before byte-level BPE.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokens = tdict["tokens"]
    types = g.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if int(ty) == 3]
    if special:
        backend.add_special_tokens(special)

    def tok(key: str) -> str | None:
        idx = g.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    _add_bos_eos(g, backend, tok)
    kwargs: dict[str, Any] = dict(tokenizer_object=backend, bos_token=tok("bos_token_id"),
                                  eos_token=tok("eos_token_id"), unk_token=tok("unknown_token_id"),
                                  pad_token=tok("padding_token_id"))
    kwargs.update({k: v for k, v in (extra or {}).items() if k not in kwargs})
    fast = PreTrainedTokenizerFast(**kwargs)
    template = g.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def write_mlx_folder(g: GGUFModel, folder: Path, *, dtype: str = "float32",
                     permute: bool = True, progress: ProgressFn | None = None) -> int:
    """Write weights, config, generation config and tokenizer of ``g`` into ``folder``.

    Returns the parameter count.
    """
    from safetensors.numpy import save_file

    weights = convert_tensors(g, dtype, permute=permute, progress=progress)
    config = build_config(g, "lm_head.weight" in weights, dtype)
    tokenizer = build_tokenizer(g)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    eos = [i for i in [config.get("eos_token_id")] if i is not None]
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos[0] if len(eos) == 1 else eos,
         "bos_token_id": config.get("bos_token_id")}, indent=2))
    tokenizer.save_pretrained(str(folder))
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(0o644)
    return int(sum(w.size for w in weights.values()))


def open_gguf(src: Path) -> GGUFModel:
    """Open a GGUF file whose architecture has a converter (clear errors otherwise)."""
    src = Path(src)
    if not src.is_file():
        raise ConversionError(f"GGUF file not found: {src}")
    g = GGUFModel(src)
    if g.arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"GGUF architecture '{g.arch or '?'}' is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return g


def convert_gguf(src: Path, out: Path, *, dtype: str = "float32", permute: bool = True,
                 progress: ProgressFn | None = None) -> ConversionResult:
    """Convert ``src`` (a GGUF file) into an MLX folder at ``out`` (atomically).

    ``permute=False`` skips undoing llama.cpp's Q/K row permutation: the result
    loads but talks nonsense (used to prove that qualification catches it).
    """
    from mlxd.sources.staging import staged_folder

    t0 = time.monotonic()
    if dtype not in ("float32", "float16"):
        raise ConversionError(f"dtype {dtype!r} not supported for GGUF conversion; use float32 "
                              "or float16 (other dtypes and quantisation: `mlxd model convert`)")
    g = open_gguf(src)
    with staged_folder(Path(out), force=True) as staging:
        params = write_mlx_folder(g, staging, dtype=dtype, permute=permute, progress=progress)
    return ConversionResult(Path(out), g.arch, len(g.tensors), params, dtype,
                            time.monotonic() - t0, g.quantization_summary())
