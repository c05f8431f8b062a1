"""What the embedding and rerank engines share: one ``TokenBatcher`` per loaded
encoder, stepped by the model's worker thread."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.config import ServerConfig
from mlxd.engines.device import device_name, weights_nbytes
from mlxd.engines.encoders.token_batcher import BatchForward, Encoded, TokenBatcher, padding_policy
from mlxd.errors import InvalidRequest
from mlxd.models.engine import EngineFacts, EngineStats
from mlxd.runtime.worker import ModelWorker


class BatchedEncoder:
    """Base of encoder engines: batching, closing and memory accounting."""

    def __init__(self, name: str, path: Path, worker: ModelWorker, config: ServerConfig) -> None:
        self.name = name
        self.path = Path(path)
        self.worker = worker
        self.batch_tokens = config.encoder_batch_tokens
        self.model: Any = None
        self.tokenizer: Any = None
        self.fast_gelu = 0
        self.batcher: TokenBatcher | None = None
        self._pad_id = 0
        self._weights_bytes = 0
        self._tokenizer_lock = threading.Lock()  # HF tokenizers mutate truncation state

    def _start_batching(self, forward: BatchForward, warm_up: list[Encoded]) -> np.ndarray:
        """Count the weights, run one warm-up batch, then let the worker step the queue."""
        self._weights_bytes = weights_nbytes(self.model)
        self.batcher = TokenBatcher(forward, token_budget=self.batch_tokens,
                                    padding=padding_policy(device_name()),
                                    wake=self.worker.wake)
        out = forward(warm_up)
        self.worker.set_stepper(self.batcher)
        return out

    async def _run(self, encoded: list[Encoded]) -> np.ndarray:
        """The forward results for ``encoded``, batched with other requests."""
        if self.batcher is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        job = self.batcher.submit(encoded)
        return await job.reply

    def close(self) -> None:
        """Fail queued work, drop the weights."""
        if self.batcher is not None:
            self.batcher.close()
        self.worker.set_stepper(None)
        self.batcher = None
        self.model = None
        gc.collect()
        mx.clear_cache()

    def memory_bytes(self) -> int:
        return self._weights_bytes

    def describe(self) -> dict[str, Any]:
        """What ``/v1/models`` shows of this model."""
        raise NotImplementedError

    def facts(self) -> EngineFacts:
        return EngineFacts(card=self.describe())

    def stats(self) -> EngineStats:
        return EngineStats(counters=self.batcher.stats() if self.batcher else {})

    def persist_state(self) -> int:
        return 0  # nothing outlives an unload
