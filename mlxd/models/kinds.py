"""One home per model kind: what detection, the kind check, ``/v1/models`` and the
memory budget know about it.

A ``KindSpec`` names the kind's family protocol (``engines/base.py``), the engine
class that serves it (an import path: nothing here imports MLX or an engine), the
optional extra its packages come in, the ``model_type`` values detection accepts for
it (``None``: whatever its loader has a module for), and its activation reserve
above the weights when no closer estimate applies (``models/memory.py``).
``engines/registry.py`` builds its engine table from ``KINDS``;
``tests/test_kinds.py`` checks that every ``model_type`` accepted here is one the
kind's engine loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from mlxd.models.spec import ModelKind


@dataclass(frozen=True)
class KindSpec:
    """Everything mlxd knows about one model kind, in one place."""

    kind: ModelKind
    protocol: str  # the family protocol in engines/base.py
    engine: str | None  # "module:Class", imported on first use; None: no engine yet
    extra: str | None  # the optional extra its packages come in (None: the base install)
    # The engine constructor's fourth argument: "text" engines get TextEngineOptions
    # (generation limits), the others the ServerConfig.
    options: Literal["text", "server"] = "server"
    model_types: frozenset[str] | None = None  # None: any its loader has a module for
    activation_reserve: float = 0.25  # of the weights, when no closer estimate applies


# The importable top-level modules each extra installs (pyproject.toml's extras): the
# engine registry probes them (``find_spec``, never imported) before it serves a kind.
EXTRA_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "embeddings": ("mlx_embeddings", "transformers"),
    "vision": ("mlx_vlm", "PIL"),
    "audio": ("mlx_whisper", "mlx_audio", "av", "onnxruntime"),
})

# Cross-encoders ``engines/encoders/cross_encoder.py`` computes (its SUPPORTED_MODEL_TYPES).
RERANK_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "xlm_roberta", "camembert"})

KINDS: Mapping[ModelKind, KindSpec] = MappingProxyType({
    ModelKind.TEXT: KindSpec(ModelKind.TEXT, "TextGenerator",
                             "mlxd.engines.text.engine:MLXLanguageModel", None, "text"),
    ModelKind.VISION: KindSpec(ModelKind.VISION, "TextGenerator",
                               "mlxd.engines.vision.engine:MLXMultimodalLM", "vision", "text"),
    ModelKind.EMBEDDING: KindSpec(ModelKind.EMBEDDING, "Embedder",
                                  "mlxd.engines.encoders.embeddings:EmbeddingEngine",
                                  "embeddings"),
    ModelKind.RERANK: KindSpec(ModelKind.RERANK, "Reranker",
                               "mlxd.engines.encoders.rerank:RerankEngine", "embeddings",
                               model_types=RERANK_MODEL_TYPES),
    ModelKind.STT: KindSpec(ModelKind.STT, "Transcriber", "mlxd.engines.audio.stt:STTEngine",
                            "audio", activation_reserve=0.5),
    ModelKind.TTS: KindSpec(ModelKind.TTS, "SpeechSynthesizer",
                            "mlxd.engines.audio.tts:TTSEngine", "audio", activation_reserve=0.5),
})
