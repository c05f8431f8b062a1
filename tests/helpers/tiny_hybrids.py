"""Tiny random-weight hybrid models (attention + recurrent layers) of real mlx-lm
architectures, saved as MLX folders that mlx-lm loads like any other.

The tokenizer is copied from another tiny model folder (``tiny_models.build_llama``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _configs(vocab: int) -> dict[str, dict[str, Any]]:
    common = {"vocab_size": vocab, "hidden_size": 64, "max_position_embeddings": 4096}
    return {
        "qwen3_5": {"model_type": "qwen3_5", "text_config": {
            **common, "model_type": "qwen3_5_text", "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "head_dim": 16,
            "full_attention_interval": 2, "tie_word_embeddings": True,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "type": "default"}}},
        "qwen3_next": {
            **common, "model_type": "qwen3_next", "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [], "moe_intermediate_size": 32, "rms_norm_eps": 1e-6,
            "num_key_value_heads": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "head_dim": 16, "full_attention_interval": 2, "tie_word_embeddings": True},
        "nemotron_h": {
            **common, "model_type": "nemotron_h", "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
            "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
            "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
            "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
            "hybrid_override_pattern": ["M", "*", "M", "-"], "head_dim": 16,
            "time_step_limit": [0.0, 1e9], "tie_word_embeddings": True},
    }


ARCHITECTURES = ("qwen3_5", "qwen3_next", "nemotron_h")


def build_hybrid(out: Path, arch: str, tokenizer_from: Path, seed: int = 0) -> Path:
    """Build a random ``arch`` model folder with ``tokenizer_from``'s tokenizer; returns ``out``."""
    from tests.helpers.tiny_models import save_random_mlx_lm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        (out / name).write_bytes((Path(tokenizer_from) / name).read_bytes())
    vocab = json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"]
    eos = json.loads((Path(tokenizer_from) / "generation_config.json").read_text())["eos_token_id"]
    return save_random_mlx_lm(out, {**_configs(vocab)[arch], "eos_token_id": eos}, seed)
