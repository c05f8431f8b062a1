"""GGUF -> MLX conversion of the real SmolLM2 starter model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxd.sources.gguf_convert import (
    ConversionError,
    GGUFModel,
    build_tokenizer,
    convert_gguf,
    hf_tensor_name,
    unpermute_qk,
)

pytestmark = pytest.mark.real_model


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute`` (the operation we must undo)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((9, 64, 576), (3, 64, 576), (4, 8, 5)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
        assert not np.array_equal(llama_cpp_permute(w, heads), w)


def test_tensor_names_map_to_the_mlx_lm_layout() -> None:
    assert hf_tensor_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.7.attn_q.weight", "llama") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "llama") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_k.bias", "qwen2") == "model.layers.2.self_attn.k_proj.bias"
    with pytest.raises(ConversionError):
        hf_tensor_name("blk.0.mystery.weight", "llama")


def test_converted_smollm2_has_every_tensor_with_the_right_shape(smollm2: Path) -> None:
    from safetensors import safe_open

    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    with safe_open(str(smollm2 / "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.29.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.gate_proj.weight").get_shape() == [1536, 576]
    assert len(keys) == 2 + 30 * 9
    assert "lm_head.weight" not in keys


def test_tokenizer_round_trips_mixed_text_digits_and_specials(smollm2_gguf: Path) -> None:
    tok = build_tokenizer(GGUFModel(smollm2_gguf))
    text = "Héllo, wörld! Prices: 12345 € and 3.14159 — naïve café 🙂\n\tTabs."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    digits = tok.encode("2024", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    chat = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.decode(ids) == chat


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ConversionError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _greedy_answer(folder: Path) -> str:
    from mlx_lm import generate, load

    model, tok = load(str(folder))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    return generate(model, tok, prompt, max_tokens=20)


@pytest.mark.slow
def test_converted_model_answers_paris(smollm2: Path) -> None:
    assert "Paris" in _greedy_answer(smollm2)


@pytest.mark.slow
def test_without_qk_unpermutation_the_model_talks_nonsense(smollm2_gguf: Path,
                                                           tmp_path: Path) -> None:
    out = convert_gguf(smollm2_gguf, tmp_path / "no-permute", permute=False)
    assert "Paris" not in _greedy_answer(out.output)
