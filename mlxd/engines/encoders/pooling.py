"""How an embedding model turns token states into one vector: its own configuration.

Sentence-transformers folders say it in files: ``modules.json`` lists the
pipeline (Transformer -> Pooling -> [Dense] -> [Normalize]), the pooling
module's ``config.json`` (usually ``1_Pooling/``) names the modes,
``sentence_bert_config.json`` the maximum sequence length and lower-casing,
``config_sentence_transformers.json`` the default prompt. A folder without
them gets mean pooling (last-token for decoder models) and normalisation.

Matryoshka: a model allows ``dimensions`` when its ``config.json`` or
``config_sentence_transformers.json`` lists ``matryoshka_dimensions`` (the
sizes it was trained to be cut to, as jina-embeddings-v3 does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.jsonfile import read_json_object

# sentence-transformers' Pooling concatenates its modes in this order.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                 "mean": "pooling_mode_mean_tokens",
                 "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
                 "weightedmean": "pooling_mode_weightedmean_tokens",
                 "lasttoken": "pooling_mode_lasttoken"}
DECODER_MODEL_TYPES = {"qwen3", "qwen2", "llama", "mistral", "gemma2", "lfm2"}
ROBERTA_POSITION_TYPES = {"roberta", "xlm-roberta", "xlm_roberta", "camembert"}


class UnsupportedEmbeddingLayout(ValueError):
    """The folder asks for a pipeline step this server does not implement."""


@dataclass
class EmbeddingSettings:
    """Pooling, normalisation and length limits of one embedding model."""

    pooling: list[str] = field(default_factory=lambda: ["mean"])
    normalize: bool = True
    max_length: int = 512
    lower_case: bool = False
    prompt: str = ""
    dense_modules: int = 0
    matryoshka_dimensions: list[int] = field(default_factory=list)
    source: str = "defaults"


def _read_modules(folder: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def pooling_modes(pooling_config: dict[str, Any]) -> list[str]:
    """The modes a sentence-transformers Pooling config enables, in concatenation order."""
    mode = pooling_config.get("pooling_mode")
    if isinstance(mode, str):  # the short form some configs use
        mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max",
                "last_token": "lasttoken"}.get(mode, mode)
        if mode not in POOLING_MODES:
            raise UnsupportedEmbeddingLayout(f"unknown pooling mode {mode!r}")
        return [mode]
    modes = [m for m in POOLING_MODES if pooling_config.get(_POOLING_KEYS[m])]
    return modes or ["mean"]


def position_limit(config: dict[str, Any]) -> int | None:
    """Longest input the position embeddings allow (RoBERTa offsets by ``padding_idx + 1``)."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int) or limit <= 0:
        return None
    if str(config.get("model_type", "")).lower() in ROBERTA_POSITION_TYPES:
        limit -= int(config.get("pad_token_id", 1)) + 1
    return limit


def max_length_of(config: dict[str, Any], tokenizer_limit: int | None,
                  declared: int | None = None) -> int:
    """Declared limit (sentence_bert_config), else the tokenizer's, capped by the positions."""
    candidates = [v for v in (declared, tokenizer_limit) if isinstance(v, int) and 0 < v < 1 << 20]
    positions = position_limit(config)
    length = candidates[0] if candidates else positions or 512
    return min(length, positions) if positions else length


def _matryoshka(*configs: dict[str, Any]) -> list[int]:
    for cfg in configs:
        dims = cfg.get("matryoshka_dimensions")
        if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
            return sorted(set(dims))
    return []


def read_settings(folder: Path, config: dict[str, Any],
                  tokenizer_limit: int | None) -> EmbeddingSettings:
    """The embedding pipeline ``folder`` declares (see the module docstring)."""
    folder = Path(folder)
    modules = _read_modules(folder)
    bert_cfg = read_json_object(folder / "sentence_bert_config.json")
    st_cfg = read_json_object(folder / "config_sentence_transformers.json")
    declared = bert_cfg.get("max_seq_length")
    settings = EmbeddingSettings(
        max_length=max_length_of(config, tokenizer_limit, declared if isinstance(declared, int)
                                 else None),
        lower_case=bool(bert_cfg.get("do_lower_case", False)),
        matryoshka_dimensions=_matryoshka(config, st_cfg))
    prompts = st_cfg.get("prompts") or {}
    default_prompt = st_cfg.get("default_prompt_name")
    if isinstance(prompts, dict) and default_prompt in prompts:
        settings.prompt = str(prompts[default_prompt])
    if not modules:
        model_type = str(config.get("model_type", "")).lower()
        settings.pooling = ["lasttoken"] if model_type in DECODER_MODEL_TYPES else ["mean"]
        return settings
    settings.source = "sentence-transformers"
    settings.normalize = False
    seen_pooling = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            settings.pooling = pooling_modes(read_json_object(path / "config.json"))
            seen_pooling = True
        elif kind == "Normalize":
            settings.normalize = True
        elif kind == "Dense":
            settings.dense_modules += 1
        else:
            raise UnsupportedEmbeddingLayout(
                f"modules.json lists a {module.get('type')!r} step, which mlxd does not run")
    if not seen_pooling:
        settings.pooling = ["mean"]
    return settings


def pool(hidden: mx.array, mask: mx.array, modes: list[str]) -> mx.array:
    """Pool ``hidden`` (batch, length, dim) over the tokens where ``mask`` is 1."""
    hidden = hidden.astype(mx.float32)
    m = mask.astype(mx.float32)[..., None]
    counts = mx.maximum(m.sum(axis=1), 1e-9)
    outputs = []
    for mode in modes:
        if mode == "cls":
            outputs.append(hidden[:, 0])
        elif mode == "max":
            outputs.append(mx.where(m > 0, hidden, -1e9).max(axis=1))
        elif mode == "mean":
            outputs.append((hidden * m).sum(axis=1) / counts)
        elif mode == "mean_sqrt_len":
            outputs.append((hidden * m).sum(axis=1) / mx.sqrt(counts))
        elif mode == "weightedmean":
            weights = mx.arange(1, hidden.shape[1] + 1, dtype=mx.float32)[None, :, None] * m
            outputs.append((hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9))
        elif mode == "lasttoken":
            last = mask.astype(mx.int32).sum(axis=1) - 1
            outputs.append(hidden[mx.arange(hidden.shape[0]), mx.maximum(last, 0)])
        else:
            raise UnsupportedEmbeddingLayout(f"unknown pooling mode {mode!r}")
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)


def l2_normalize(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
