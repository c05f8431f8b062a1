"""The lifecycle every engine shares, and the typed facts and stats it reports.

It lives here, below ``engines/``, so that ``ResidencyManager``, ``ModelManager`` and
their leases hold engines by this type (never ``Any``), and the HTTP layer reads an
engine's facts and counters as fields, never as dictionary keys. The family call
surfaces (``TextGenerator``, ``Transcriber``...) extend ``ModelEngine`` in
``engines/base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Voice:
    id: str  # what ``SpeechRequest.voice`` names
    name: str
    language: str | None = None


@dataclass(frozen=True)
class EngineFacts:
    """What a loaded model is: fixed from load to unload.

    ``card`` is what ``/v1/models`` shows of it (context length, batching mode,
    parsers...); the other fields are the facts the server acts on.
    """

    context_length: int | None = None  # text models: tokens the context holds
    reasoning_parser: str | None = None  # text models: None when it does not think
    sample_rate: int | None = None  # audio models: Hz of the audio read or spoken
    voices: tuple[Voice, ...] = ()  # speech models
    card: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    nbytes: int = 0
    entries: int | None = None  # None: the cache does not count them
    disk_bytes: int | None = None  # None: no disk tier
    disk_reads: int = 0


@dataclass(frozen=True)
class KVStats:
    """Admission by live KV (``engines/text/kv_admission.py``)."""

    live_bytes: int = 0  # KV the running sequences hold now
    granted_bytes: int = 0  # KV they are expected to hold (admission counts this)
    peak_live_bytes: int = 0
    allowance_bytes: int = 0  # at the last check
    preemptions: int = 0
    waiting_for_memory: int = 0  # queued sequences that the allowance holds back now
    bytes_per_token: int = 0  # KV one token takes (quantized: its bits, scales and biases)
    transient_bytes: int = 0  # what one step holds beyond the live KV (counted, reserved)


@dataclass(frozen=True)
class RankMemory:
    rank: int
    memory_bytes: int


@dataclass(frozen=True)
class GroupStats:
    """A sharded model's group (``engines/distributed``)."""

    size: int
    backend: str
    split: str
    healthy: bool
    error: str | None
    ranks: tuple[RankMemory, ...]


@dataclass(frozen=True)
class SchedulerStats:
    """A batching scheduler's counters (text and vision models)."""

    steps: int = 0
    batch_sizes: tuple[int, ...] = ()  # steps counted per batch size (index: size)
    draft: tuple[int, int] | None = None  # (accepted, rejected) draft tokens; None: no draft
    kv: KVStats | None = None  # None: no admission by live KV


@dataclass(frozen=True)
class EngineStats:
    """Live counters, read by ``/health`` (load) and ``/metrics``, from any thread.

    ``counters`` holds a family's own counts (rows encoded, sentences spoken...).
    """

    running: int = 0  # sequences decoding now
    waiting: int = 0  # sequences queued
    scheduler: SchedulerStats | None = None
    prefix_cache: PrefixCacheStats | None = None
    group: GroupStats | None = None
    counters: Mapping[str, int | float] = field(default_factory=dict)


@runtime_checkable
class ModelEngine(Protocol):
    """A loaded model of any family. ``load``, ``close`` and ``persist_state`` run on its
    worker thread; ``facts`` and ``stats`` on any thread."""

    def load(self) -> None:
        """Load weights; raise ``ModelLoadError`` with a clear reason on failure."""

    def close(self) -> None:
        """Stop work and release memory. Safe to call twice."""

    def memory_bytes(self) -> int:
        """Bytes this model holds now (weights, caches, buffers)."""

    def persist_state(self) -> int:
        """Save what should outlive an unload (e.g. the prefix cache), before ``close``;
        the number of entries saved (0: nothing to keep)."""

    def facts(self) -> EngineFacts:
        """What the model is (context, voices, sample rate, its ``/v1/models`` card)."""

    def stats(self) -> EngineStats:
        """Live counters for ``/health`` and ``/metrics``."""
