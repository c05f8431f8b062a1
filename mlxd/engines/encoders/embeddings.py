"""``EmbeddingEngine``: text embeddings over mlx-embeddings.

mlx-embeddings loads the weights and tokenizer of every family it ships
(BERT, XLM-RoBERTa, ModernBERT, Qwen3, Gemma 3, ...); its models return token
states plus a fixed "mean-pool and normalise" vector. Pooling, normalisation,
max length, lower-casing and the default prompt come instead from the model
folder's own sentence-transformers configuration (``engines/encoders/pooling.py``), so
a CLS-pooled or un-normalised model embeds as its authors meant.

Requests are tokenised off the event loop, then queued on a ``TokenBatcher``
that the model's worker thread drains: concurrent requests share padded
batches, and no model code runs on the event loop.
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
from mlxd.engines.encoders.encoder import BatchedEncoder
from mlxd.engines.encoders.pooling import (
    EmbeddingSettings,
    UnsupportedEmbeddingLayout,
    l2_normalize,
    pool,
    read_settings,
)
from mlxd.engines.encoders.token_batcher import Encoded
from mlxd.engines.kernels.activations import use_fast_gelu
from mlxd.engines.text.prompt_limits import char_bound, char_groups, embedding_rows, max_token_chars
from mlxd.engines.upstream import mlx_embeddings as embeddings_internals
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.runtime.worker import ModelWorker

log = logging.getLogger(__name__)

# mlx-embeddings model types whose forward pass itself applies the folder's
# Dense modules after pooling (and normalises): we use their ``text_embeds``.
MODELS_APPLYING_DENSE = {"gemma3_text"}

EmbeddingInput = str | list[int]


def pad_batch(batch: Sequence[Encoded], pad_id: int) -> tuple[mx.array, mx.array, mx.array]:
    """Right-pad a batch: (input_ids, attention_mask, token_type_ids) as int32 arrays."""
    longest = max(len(x) for x in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int32)
    mask = np.zeros((len(batch), longest), dtype=np.int32)
    types = np.zeros((len(batch), longest), dtype=np.int32)
    for row, item in enumerate(batch):
        n = len(item.input_ids)
        ids[row, :n] = item.input_ids
        mask[row, :n] = 1
        if item.token_type_ids is not None:
            types[row, :n] = item.token_type_ids
    return mx.array(ids), mx.array(mask), mx.array(types)


def truncate_dimensions(vectors: np.ndarray, dimensions: int, renormalize: bool) -> np.ndarray:
    """Matryoshka: keep the first ``dimensions`` values (then L2-normalise again)."""
    cut = np.ascontiguousarray(vectors[:, :dimensions], dtype=np.float32)
    if renormalize:
        norms = np.linalg.norm(cut, axis=1, keepdims=True)
        cut = cut / np.maximum(norms, 1e-12)
    return cut


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text (BERT's ``[CLS]``; often none)."""
    try:
        full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer without the flag: no tell
        return []
    for start in range(len(full) - len(plain) + 1):
        if plain and full[start:start + len(plain)] == plain:
            return [int(t) for t in full[:start]]
    return []

class EmbeddingEngine(BatchedEncoder):
    """An embedding model served through batched forward passes on its worker thread."""

    kind = "embedding"

    def __init__(self, name: str, path: Path, worker: ModelWorker, config: ServerConfig) -> None:
        super().__init__(name, path, worker, config)
        self.overflow = config.embedding_overflow
        self.model_config: dict[str, Any] = {}
        self.settings = EmbeddingSettings()
        self.dimensions = 0
        self.vocab_size = 0
        self._token_chars = 64
        self._model_pools = False
        self._id_prefix: list[int] = []  # what the tokenizer puts before any text ([CLS])

    # -- lifecycle (worker thread) -----------------------------------------------
    def load(self) -> None:
        """Load weights and tokenizer, read the pooling config, run one warm-up batch."""
        from mlx_embeddings.utils import load, load_config

        embeddings_internals.ADAPTER.require(self.name)
        try:
            self.model_config = load_config(self.path)
            model, wrapper = load(str(self.path))
        except Exception as e:
            raise ModelLoadError(self.name, f"mlx-embeddings cannot load {self.path}: "
                                            f"{type(e).__name__}: {e}") from e
        tokenizer = embeddings_internals.hf_tokenizer(wrapper)
        if not hasattr(tokenizer, "model_max_length") or not callable(tokenizer):
            raise ModelLoadError(self.name, "this model needs an image processor; mlxd serves "
                                            "text embedding models only")
        self.model, self.tokenizer = model, tokenizer
        self._configure()
        if device_name() == "cpu":  # erf is slow on MLX's CPU backend
            self.fast_gelu = use_fast_gelu(model)
        warm = self._start_batching(self._forward, [self._encode_texts(["warm up"])[0]])
        self.dimensions = int(warm.shape[-1])
        log.info("embedding model %s: %d dims, pooling %s, normalize %s, max %d tokens",
                 self.name, self.dimensions, "+".join(self.settings.pooling),
                 self.settings.normalize, self.settings.max_length)

    def _configure(self) -> None:
        limit = getattr(self.tokenizer, "model_max_length", None)
        try:
            self.settings = read_settings(self.path, self.model_config,
                                          limit if isinstance(limit, int) else None)
        except UnsupportedEmbeddingLayout as e:
            raise ModelLoadError(self.name, str(e)) from e
        model_type = str(self.model_config.get("model_type", "")).replace("-", "_")
        if self.settings.dense_modules:
            if model_type not in MODELS_APPLYING_DENSE:
                raise ModelLoadError(self.name, f"modules.json has Dense layers, which "
                                                f"mlx-embeddings applies only for "
                                                f"{sorted(MODELS_APPLYING_DENSE)}, not "
                                                f"{model_type!r}")
            self._model_pools = True
        cfg: Any = getattr(self.model, "config", None)
        if hasattr(cfg, "classifier_pooling"):  # ModernBERT pools inside the model
            if self.settings.pooling not in (["cls"], ["mean"]):
                raise ModelLoadError(self.name, "ModernBERT in mlx-embeddings pools by cls or "
                                                f"mean only, not {self.settings.pooling}")
            cfg.classifier_pooling = self.settings.pooling[0]
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else 0
        self.vocab_size = embedding_rows(self.model, self.model_config, len(self.tokenizer))
        self._token_chars = max_token_chars(self.tokenizer)
        self._id_prefix = special_prefix(self.tokenizer)

    # -- facts ----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions, "max_input_tokens": self.settings.max_length,
                "pooling": "+".join(self.settings.pooling), "normalize": self.settings.normalize,
                "matryoshka_dimensions": self.settings.matryoshka_dimensions or None,
                "overflow": self.overflow, "batch_tokens": self.batch_tokens,
                "fast_gelu": bool(self.fast_gelu)}

    # -- forward pass (worker thread) ------------------------------------------------------
    def _forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        ids, mask, _ = pad_batch(batch, self._pad_id)
        out = self.model(ids, attention_mask=mask)
        if self._model_pools:
            vectors = out.text_embeds
        else:
            hidden = out.last_hidden_state
            vectors = hidden if hidden.ndim == 2 else pool(hidden, mask, self.settings.pooling)
            if self.settings.normalize:
                vectors = l2_normalize(vectors)
        vectors = vectors.astype(mx.float32)
        mx.eval(vectors)
        return np.array(vectors, copy=True)

    # -- requests -------------------------------------------------------------------------
    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse ``dimensions`` the model does not declare (400)."""
        if dimensions is None or dimensions == self.dimensions:
            return
        allowed = self.settings.matryoshka_dimensions
        if not allowed:
            raise InvalidRequest(
                f"Model '{self.name}' produces {self.dimensions}-dimensional embeddings and does "
                "not declare Matryoshka dimensions, so 'dimensions' cannot shorten them.",
                param="dimensions", code="unsupported_dimensions")
        if dimensions not in allowed:
            raise InvalidRequest(
                f"Model '{self.name}' supports dimensions {sorted({*allowed, self.dimensions})}; "
                f"got {dimensions}.", param="dimensions", code="unsupported_dimensions")

    async def encode(self, inputs: list[EmbeddingInput]) -> list[Encoded]:
        """Tokenise texts / check token ids against the model's limits (off the event loop)."""
        return await asyncio.to_thread(self._encode, inputs)

    def _encode(self, inputs: list[EmbeddingInput]) -> list[Encoded]:
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        out: list[Encoded | None] = [None] * len(inputs)
        for (i, _), enc in zip(texts, self._encode_texts([t for _, t in texts]), strict=True):
            out[i] = enc
        for i, x in enumerate(inputs):
            if not isinstance(x, str):
                out[i] = self._check_ids(i, x)
        encoded = [enc for enc in out if enc is not None]
        for i, enc in enumerate(encoded):
            self._check_length(i, len(enc))
        return [self._truncated(enc) for enc in encoded]

    def _encode_texts(self, texts: list[str]) -> list[Encoded]:
        if not texts:
            return []
        s = self.settings
        # Under the 'error' policy one token past the limit is enough to know.
        limit = s.max_length if self.overflow == "truncate" else s.max_length + 1
        # The tokenizer truncates only after encoding everything: cut each text first
        # where no more characters could change its first ``limit`` tokens.
        cap = char_bound(limit, self._token_chars)
        prepared = [(s.prompt + t[:cap]).lower() if s.lower_case else s.prompt + t[:cap]
                    for t in texts]
        out: list[Encoded] = []
        for group in char_groups(prepared):
            with self._tokenizer_lock:
                enc = self.tokenizer(group, add_special_tokens=True, truncation=True,
                                     max_length=limit)
            out += [Encoded(list(ids)) for ids in enc["input_ids"]]
        return out

    def _check_ids(self, index: int, ids: list[int]) -> Encoded:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"input[{index}] has token id {bad}, outside this model's "
                                 f"vocabulary [0, {self.vocab_size}).", param="input")
        prefix = self._id_prefix
        if prefix and ids[:len(prefix)] != prefix:
            # The cheap tell of another tokenizer's ids: every encoding of this model's
            # tokenizer starts with its special tokens. MLX would embed them, wrongly.
            raise InvalidRequest(
                f"input[{index}] does not start with {prefix}, the special token(s) model "
                f"'{self.name}''s tokenizer puts first: token ids must come from this model's "
                "own tokenizer, special tokens included. Ids from another tokenizer give "
                "wrong vectors (LangChain's OpenAIEmbeddings sends tiktoken ids unless "
                "check_embedding_ctx_length=False); send the text instead.",
                param="input", code="foreign_token_ids")
        return Encoded(list(ids))

    def _check_length(self, index: int, n: int) -> None:
        if n > self.settings.max_length and self.overflow == "error":
            raise InvalidRequest(
                f"input[{index}] is longer than {self.settings.max_length} tokens, the most "
                f"model '{self.name}' accepts "
                "(the server's embedding overflow policy is 'error').",
                param="input", code="context_length_exceeded")

    def _truncated(self, enc: Encoded) -> Encoded:
        limit = self.settings.max_length
        return enc if len(enc) <= limit else Encoded(enc.input_ids[:limit])

    async def embed(self, encoded: list[Encoded], dimensions: int | None = None) -> np.ndarray:
        """Embeddings of ``encoded`` as a float32 (n, dims) array, batched with other requests."""
        self.check_dimensions(dimensions)
        vectors = await self._run(encoded)
        if dimensions is not None and dimensions < vectors.shape[-1]:
            vectors = truncate_dimensions(vectors, dimensions, self.settings.normalize)
        return vectors


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import Embedder

    _implements: type[Embedder] = EmbeddingEngine
