"""The Engine protocol every model family implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    """A loaded model. ``load``/``close`` run on the model's worker thread."""

    kind: str

    def load(self) -> None:
        """Load weights; raise ``ModelLoadError`` with a clear reason on failure."""

    def close(self) -> None:
        """Stop work and release memory. Safe to call twice."""

    def memory_bytes(self) -> int:
        """Bytes this model holds now (weights, caches, buffers)."""

    def describe(self) -> dict[str, Any]:
        """Facts for ``/v1/models`` (e.g. context length, batching mode)."""
