"""``rerank_forward``: our MLX forward pass of BERT-family ``*ForSequenceClassification``.

Covers the cross-encoders rerankers ship as: BERT (cross-encoder/ms-marco-MiniLM),
RoBERTa and XLM-RoBERTa (BAAI/bge-reranker-base/large), CamemBERT. Weights come straight from the safetensors
files transformers writes; the module names mirror transformers' so keys map
one to one after the body prefix (``bert.``, ``roberta.``, none...) is found.

What differs between the families, and is honoured here:

* BERT feeds ``token_type_ids`` (0 for the query, 1 for the document);
  RoBERTa-style models have one token type and count positions from
  ``padding_idx + 1``, skipping pad tokens.
* The head is one layer on BERT's pooler (``dense`` + tanh on [CLS], then
  ``classifier``) or two layers on RoBERTa ([CLS] -> ``classifier.dense`` ->
  tanh -> ``classifier.out_proj``); found from the weight names.
* The encoder activation is the config's ``hidden_act``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_MODEL_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta",
                         "xlm_roberta": "roberta", "camembert": "roberta"}
# config.json ``hidden_act`` -> the module transformers' ACT2FN computes.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU, "gelu_python": nn.GELU, "gelu_new": lambda: nn.GELU(approx="precise"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approx="precise"),
    "gelu_fast": lambda: nn.GELU(approx="precise"),
    "quick_gelu": lambda: nn.GELU(approx="fast"), "relu": nn.ReLU, "silu": nn.SiLU,
    "swish": nn.SiLU, "tanh": nn.Tanh,
}
_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"


class UnsupportedCrossEncoder(ValueError):
    """The folder is not a cross-encoder this module can run; the message says why."""


@dataclass
class CrossEncoderConfig:
    """The config.json fields the forward pass needs."""

    family: str  # "bert" or "roberta"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    num_labels: int

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> CrossEncoderConfig:
        """Validate a transformers config.json; raises ``UnsupportedCrossEncoder``."""
        model_type = str(config.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedCrossEncoder(
                f"model_type {model_type!r} is not a supported cross-encoder family "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
        act = str(config.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            raise UnsupportedCrossEncoder(
                f"activation {act!r} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedCrossEncoder(
                f"position_embedding_type {config['position_embedding_type']!r} is not supported "
                "(only 'absolute')")
        labels = config.get("id2label") or {}
        family = SUPPORTED_MODEL_TYPES[model_type]
        try:
            return cls(
                family=family, vocab_size=int(config["vocab_size"]),
                hidden_size=int(config["hidden_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=int(config["num_attention_heads"]),
                intermediate_size=int(config["intermediate_size"]), hidden_act=act,
                max_position_embeddings=int(config["max_position_embeddings"]),
                type_vocab_size=int(config.get("type_vocab_size", 2)),
                layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                pad_token_id=int(config.get("pad_token_id", 1 if family == "roberta" else 0)),
                num_labels=int(config.get("num_labels") or len(labels) or 2))
        except KeyError as e:
            raise UnsupportedCrossEncoder(f"config.json lacks {e.args[0]!r}") from None


class Embeddings(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.family = cfg.family
        self.padding_idx = cfg.pad_token_id
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def position_ids(self, input_ids: mx.array) -> mx.array:
        if self.family == "roberta":  # transformers' create_position_ids_from_input_ids
            real = (input_ids != self.padding_idx).astype(mx.int32)
            return mx.cumsum(real, axis=1) * real + self.padding_idx
        return mx.broadcast_to(mx.arange(input_ids.shape[1])[None], input_ids.shape)

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array) -> mx.array:
        x = (self.word_embeddings(input_ids)
             + self.position_embeddings(self.position_ids(input_ids))
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // self.heads),
                                                   mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class DenseNorm(nn.Module):
    """``dense`` then ``LayerNorm(dense(x) + residual)`` (transformers' *Output blocks)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACTIVATIONS[cfg.hidden_act]()

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class Pooler(nn.Module):
    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class TwoLayerHead(nn.Module):
    """RoBERTa's classification head: [CLS] -> dense -> tanh -> out_proj."""

    def __init__(self, cfg: CrossEncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def __call__(self, cls: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(cls)))


class CrossEncoder(nn.Module):
    """Encoder body plus a sequence-classification head; call it through ``rerank_forward``."""

    def __init__(self, cfg: CrossEncoderConfig, two_layer_head: bool) -> None:
        super().__init__()
        self.config = cfg
        self.two_layer_head = two_layer_head
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        if two_layer_head:
            self.classifier: nn.Module = TwoLayerHead(cfg)
        else:
            self.pooler = Pooler(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array,
                 token_type_ids: mx.array) -> mx.array:
        dtype = self.embeddings.word_embeddings.weight.dtype
        mask = mx.where(attention_mask[:, None, None, :].astype(mx.bool_), 0.0, -1e9).astype(dtype)
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        cls = x[:, 0]
        if self.two_layer_head:
            return self.classifier(cls)
        return self.classifier(mx.tanh(self.pooler.dense(cls)))


def rerank_forward(model: CrossEncoder, input_ids: mx.array, attention_mask: mx.array,
                   token_type_ids: mx.array | None = None) -> mx.array:
    """Classification logits (batch, num_labels) for right-padded pair inputs.

    ``token_type_ids`` default to zeros (RoBERTa-style models use no others).
    """
    if token_type_ids is None or model.config.type_vocab_size < 2:
        token_type_ids = mx.zeros_like(input_ids)
    return model(input_ids, attention_mask, token_type_ids).astype(mx.float32)


def _split_weights(weights: dict[str, mx.array]) -> tuple[str, dict[str, mx.array]]:
    """Strip the body prefix (``bert.``, ``roberta.``, ...); keep the head's names."""
    anchors = [k for k in weights if k.endswith(_WORD_EMBEDDINGS)]
    if len(anchors) != 1:
        raise UnsupportedCrossEncoder(
            f"cannot find the encoder in the weights (expected one '*{_WORD_EMBEDDINGS}')")
    prefix = anchors[0][: -len(_WORD_EMBEDDINGS)]
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.endswith(("position_ids", "token_type_ids")):
            continue  # buffers some checkpoints carry
        name = key[len(prefix):] if key.startswith(prefix) else key
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        out[name.replace("LayerNorm.beta", "LayerNorm.bias")] = value
    return prefix, out


def read_weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UnsupportedCrossEncoder(
            "no *.safetensors weights in the folder (convert pytorch_model.bin to safetensors)")
    weights: dict[str, mx.array] = {}
    for f in files:
        loaded: Any = mx.load(str(f))
        weights.update(loaded)
    return weights


def load_cross_encoder(folder: Path, dtype: mx.Dtype | None = None) -> CrossEncoder:
    """Build the model from ``config.json`` and load its safetensors weights."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedCrossEncoder(f"cannot read config.json: {e}") from e
    archs = [str(a) for a in config.get("architectures") or []]
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UnsupportedCrossEncoder(
            f"architecture {archs[0]} is not a *ForSequenceClassification cross-encoder")
    cfg = CrossEncoderConfig.from_dict(config)
    if cfg.num_labels not in (1, 2):
        raise UnsupportedCrossEncoder(
            f"a reranker has 1 or 2 labels; this classifier has {cfg.num_labels}")
    _, weights = _split_weights(read_weights(folder))
    two_layer = "classifier.out_proj.weight" in weights
    if not two_layer and "pooler.dense.weight" not in weights:
        raise UnsupportedCrossEncoder("one-layer classifier head without pooler weights")
    model = CrossEncoder(cfg, two_layer)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UnsupportedCrossEncoder(f"weights do not match the config: {e}") from e
    mx.eval(model.parameters())
    model.eval()
    return model
