"""``RerankEngine``: relevance scores of query-document pairs from a cross-encoder.

Each pair is tokenised exactly as the model's own tokenizer pairs two texts
(``[CLS] q [SEP] d [SEP]`` with token types for BERT, ``<s> q </s></s> d </s>``
for RoBERTa), truncating the document first (``only_second``) to the model's
max length. Pairs from all concurrent requests are packed into padded batches
by a ``TokenBatcher`` on the model's worker thread, and run through
``rerank_forward`` (``engines/encoders/cross_encoder.py``). Score: sigmoid of the logit
for one label, softmax probability of label 1 for two.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlxd.config import ServerConfig
from mlxd.engines.device import device_name
from mlxd.engines.encoders.cross_encoder import (
    CrossEncoder,
    UnsupportedCrossEncoder,
    load_cross_encoder,
    rerank_forward,
)
from mlxd.engines.encoders.embeddings import pad_batch
from mlxd.engines.encoders.encoder import BatchedEncoder
from mlxd.engines.encoders.pooling import max_length_of
from mlxd.engines.encoders.token_batcher import Encoded
from mlxd.engines.kernels.activations import use_fast_gelu
from mlxd.engines.text.prompt_limits import char_bound, char_groups, max_token_chars
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.models.memory import read_config
from mlxd.runtime.worker import ModelWorker

log = logging.getLogger(__name__)

__all__ = ["RerankEngine", "relevance_scores", "rerank_forward"]


def relevance_scores(logits: np.ndarray) -> np.ndarray:
    """sigmoid of a single logit, or the softmax probability of label 1 of two."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits[:, 0]))).astype(np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    return probs[:, 1].astype(np.float32)


class RerankEngine(BatchedEncoder):
    """A cross-encoder reranker served through batched forward passes on its worker thread."""

    kind = "rerank"

    def __init__(self, name: str, path: Path, worker: ModelWorker, config: ServerConfig) -> None:
        super().__init__(name, path, worker, config)
        self.model: CrossEncoder | None = None
        self.max_length = 512
        self._pair_specials = 3
        self._token_chars = 64

    # -- lifecycle (worker thread) ----------------------------------------------------
    def load(self) -> None:
        """Load the classifier and its tokenizer; raises ``ModelLoadError`` with the reason."""
        from transformers import AutoTokenizer


        try:
            dtype = mx.float32 if device_name() == "cpu" else None
            self.model = load_cross_encoder(self.path, dtype=dtype)
            config = read_config(self.path)
            tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        except UnsupportedCrossEncoder as e:
            raise ModelLoadError(self.name, str(e)) from e
        except Exception as e:
            raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
        self.tokenizer = tokenizer
        self.fast_gelu = use_fast_gelu(self.model) if device_name() == "cpu" else 0
        limit = getattr(tokenizer, "model_max_length", None)
        self.max_length = max_length_of(config, limit if isinstance(limit, int) else None)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else self.model.config.pad_token_id
        self._pair_specials = int(tokenizer.num_special_tokens_to_add(pair=True))
        self._token_chars = max_token_chars(tokenizer)
        self._start_batching(self._forward, self._encode_pairs("warm up", ["warm up"]))
        log.info("rerank model %s: %s head, %d label(s), max %d tokens", self.name,
                 "two-layer" if self.model.two_layer_head else "pooler + linear",
                 self.model.config.num_labels, self.max_length)

    # -- facts --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        cfg = self.model.config if self.model is not None else None
        return {"max_input_tokens": self.max_length,
                "family": cfg.family if cfg else None,
                "num_labels": cfg.num_labels if cfg else None,
                "batch_tokens": self.batch_tokens, "fast_gelu": bool(self.fast_gelu)}

    # -- forward pass (worker thread) -------------------------------------------------------
    def _forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        assert self.model is not None
        ids, mask, types = pad_batch(batch, self._pad_id)
        logits = rerank_forward(self.model, ids, mask, types)
        mx.eval(logits)
        return np.array(logits, copy=True)

    # -- requests ---------------------------------------------------------------------------
    async def encode(self, query: str, documents: list[str]) -> list[Encoded]:
        """Tokenise the pairs as the model's tokenizer pairs them (off the event loop)."""
        return await asyncio.to_thread(self._encode_pairs, query, documents)

    def _encode_pairs(self, query: str, documents: list[str]) -> list[Encoded]:
        # The tokenizer truncates only after encoding everything: cut each text first
        # where no more characters could change the tokens a pair keeps.
        cap = char_bound(self.max_length, self._token_chars)
        query = query[:cap]
        with self._tokenizer_lock:
            query_ids = self.tokenizer(query, add_special_tokens=False, truncation=True,
                                       max_length=self.max_length)["input_ids"]
        if len(query_ids) + self._pair_specials >= self.max_length:
            raise InvalidRequest(
                f"The query is too long: model '{self.name}' reads at most "
                f"{self.max_length} tokens per query-document pair, and the query fills "
                "them, leaving no room for the document.", param="query",
                code="context_length_exceeded")
        out: list[Encoded] = []
        for group in char_groups([d[:cap] for d in documents]):
            with self._tokenizer_lock:
                enc = self.tokenizer([query] * len(group), group, truncation="only_second",
                                     max_length=self.max_length)
            types = enc.get("token_type_ids")
            out += [Encoded(list(ids), list(types[i]) if types is not None else None)
                    for i, ids in enumerate(enc["input_ids"])]
        return out

    async def logits(self, encoded: list[Encoded]) -> np.ndarray:
        """Classifier logits (n, num_labels), batched with other requests' pairs."""
        return await self._run(encoded)

    async def score(self, encoded: list[Encoded]) -> np.ndarray:
        """Relevance scores in [0, 1], one per pair, in order."""
        return relevance_scores(await self.logits(encoded))


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import Reranker

    _implements: type[Reranker] = RerankEngine
