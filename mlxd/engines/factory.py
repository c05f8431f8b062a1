"""Build and load the engine for a registry entry, on the model's worker thread.

The engine receives a local folder: the source was resolved (downloaded,
converted) before, by the models layer (``models/loading.py``);
``build_loader`` joins the two into the ModelManager's loader. Engine modules
are imported here, lazily, so nothing above this layer imports MLX.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxd.config import ServerConfig
from mlxd.engines.registry import EngineRegistry
from mlxd.models.loading import ModelLoader, ProgressFactory, SourceResolver
from mlxd.models.memory import prefix_cache_bytes
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.runtime.distributed import group_options
from mlxd.runtime.worker import ModelWorker
from mlxd.sources.resolve import resolve_source

if TYPE_CHECKING:
    from mlxd.engines.base import ModelEngine

log = logging.getLogger(__name__)


class EngineFactory:
    """Engines by kind: ``build(entry, kind, path, worker) -> loaded engine``."""

    def __init__(self, config: ServerConfig, budget_bytes: int,
                 engines: EngineRegistry | None = None) -> None:
        self.config = config
        self.budget_bytes = budget_bytes
        self.engines = engines or EngineRegistry()

    def create(self, entry: ModelEntry, kind: ModelKind, path: Path,
               worker: ModelWorker) -> ModelEngine:
        """The kind's engine from the registry, constructed (not loaded)."""
        engine_class = self.engines.engine_class(kind, entry.name)
        spec = self.engines.specs[kind]
        options = self.text_options(entry, kind) if spec.options == "text" else self.config
        return engine_class(entry.name, path, worker, options)

    def text_options(self, entry: ModelEntry, kind: ModelKind = ModelKind.TEXT) -> Any:
        from mlxd.engines.text.engine import TextEngineOptions
        from mlxd.engines.text.speculative import SpeculativeOptions

        cfg, d = self.config, entry.defaults
        kv_bits = d.kv_bits or cfg.kv_bits
        if kind is ModelKind.VISION and not d.kv_bits and cfg.kv_bits:
            # the server-wide flag is for text models: mlx-vlm's batch keeps its own KV
            # caches, so a vision model keeps full precision (an entry's own kv_bits on a
            # vision model is still refused at load, naming it)
            log.info("--kv-bits applies to text models: %s (a vision model) keeps "
                     "full-precision KV", entry.name)
            kv_bits = None
        safe_name = entry.name.replace("/", "--")
        return TextEngineOptions(
            max_num_seqs=d.max_num_seqs or cfg.max_num_seqs, max_queue=cfg.max_queue,
            prefill_step_size=cfg.prefill_step_size,
            prefix_cache_bytes=prefix_cache_bytes(cfg, self.budget_bytes),
            batching=cfg.batching, max_context=d.max_context or cfg.max_context,
            kv_output_estimate=cfg.kv_output_estimate,
            reasoning_parser=entry.reasoning_parser or cfg.reasoning_parser,
            tool_call_parser=entry.tool_call_parser or cfg.tool_call_parser,
            trust_remote_code=entry.trust_remote_code,
            prefix_cache_disk_bytes=cfg.prefix_cache_disk_bytes if not cfg.hosts else 0,
            prefix_cache_disk_dir=cfg.prefix_cache_disk_dir / safe_name,
            prefix_cache_dir=(cfg.prefix_cache_dir / safe_name
                              if cfg.enable_prefix_cache_persist and not cfg.hosts else None),
            group=group_options(cfg),
            speculative=SpeculativeOptions(mode=speculative_mode(cfg.speculative, entry),
                                           num_draft_tokens=cfg.num_draft_tokens),
            draft_model=self.draft_path(entry),
            adapters={name: Path(folder) for name, folder in entry.adapters.items()},
            kv_bits=kv_bits,
            kv_group_size=d.kv_group_size or cfg.kv_group_size)

    def draft_path(self, entry: ModelEntry) -> Path | None:
        """The entry's draft model as a local folder (downloaded or converted if needed),
        when it will draft (``--speculative`` auto or draft; not sharded over --hosts)."""
        cfg = self.config
        if not entry.draft_model or cfg.speculative not in ("auto", "draft") or cfg.hosts:
            return None
        return resolve_source(entry.draft_model, home=cfg.home, dtype=float_dtype(),
                              name=f"{entry.name} (draft model)")

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: ModelWorker) -> Any:
        """Construct and load the kind's engine from the local folder ``path``."""
        if entry.trust_remote_code is False and self.config.trust_remote_code:
            log.warning("--trust-remote-code applies only to entries that set trust_remote_code")
        from mlxd.engines.device import release_thread_memory

        worker.at_exit(release_thread_memory)  # after the engine closed, on its thread
        engine = self.create(entry, kind, path, worker)
        engine.load()
        return engine


def speculative_mode(mode: str, entry: ModelEntry) -> str:
    """``--speculative`` for one entry: auto or draft drafts with its draft model when it
    has one; draft without one is off (entries without a draft model do not speculate)."""
    if entry.draft_model and mode in ("auto", "draft"):
        return "draft"
    return "off" if mode == "draft" else mode


def float_dtype() -> str:
    """The dtype GGUF sources are converted to on this device (imports MLX when called)."""
    from mlxd.engines.device import preferred_float_dtype

    return preferred_float_dtype()


def build_loader(config: ServerConfig, budget_bytes: int,
                 progress: ProgressFactory | None = None,
                 engines: EngineRegistry | None = None) -> ModelLoader:
    """The ModelManager's loader: the models layer resolves each source to a local folder
    (with ``progress``), then an ``EngineFactory`` builds and loads the engine from it."""
    return ModelLoader(SourceResolver(config.home, float_dtype, progress),
                       EngineFactory(config, budget_bytes, engines).build)
