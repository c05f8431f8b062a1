"""Tiny GGUF files written the way llama.cpp's converter writes them, from tiny MLX models.

Given a random-weight MLX folder (llama, qwen2 or qwen3; tests/helpers/tiny_models.py
builds the tokenizer), ``write_gguf`` renames the tensors to GGUF names, permutes Q/K
rows for llama (llama.cpp's ``LlamaModel.permute``), writes the metadata and the
byte-level BPE vocabulary, so the converter can be checked against the original.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (halves -> interleaved, per head)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    if hf.startswith("model.embed_tokens."):
        return "token_embd." + hf.rsplit(".", 1)[1]
    if hf.startswith("model.norm."):
        return "output_norm." + hf.rsplit(".", 1)[1]
    if hf.startswith("lm_head."):
        return "output." + hf.rsplit(".", 1)[1]
    _, _, layer, *rest = hf.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def _tokenizer_metadata(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": tokens, "merges": merges,
            "types": [3 if t in specials else 1 for t in tokens]}


def write_gguf(folder: Path, out: Path, arch: str) -> Path:
    """Write the MLX model in ``folder`` as an F32 GGUF of architecture ``arch``."""
    import gguf
    import mlx.core as mx

    cfg = json.loads((folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = _tokenizer_metadata(folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])
    weights = {k: np.array(v.astype(mx.float32)) for k, v in
               mx.load(str(folder / "model.safetensors")).items()}
    for name, value in sorted(weights.items()):
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build_random(out: Path, arch: str, tokenizer_from: Path, *, hidden: int = 64,
                 layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A random qwen2 / qwen3 MLX folder with the tiny tokenizer of ``tokenizer_from``."""
    from tests.helpers.tiny_models import save_random_mlx_lm

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((tokenizer_from / name).read_bytes())
    base = json.loads((tokenizer_from / "config.json").read_text())
    config = {**{k: base[k] for k in ("vocab_size", "eos_token_id", "pad_token_id",
                                      "max_position_embeddings", "rms_norm_eps")},
              "architectures": [f"{arch.capitalize()}ForCausalLM"], "model_type": arch,
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": hidden * 3,
              "rope_theta": 10000.0, "tie_word_embeddings": True, "head_dim": hidden // heads,
              "hidden_act": "silu", "torch_dtype": "float32"}
    return save_random_mlx_lm(out, config, seed)
