"""Narrow, reversible fixes to mlx-audio, applied only while a model of their family is loaded.

The same rules and machinery as the vision patches (``Patch``,
``PatchRegistry``: version-checked, self-checked on unknown versions,
reference counted, undone with the very objects that were there when the
last model of the family unloads: ``engines/upstream/patching.py``); this
registry holds the audio patches.
"""

from __future__ import annotations

from mlxd.engines.upstream.patching import Patch, PatchHandle, PatchRegistry, ProcessRegistry

__all__ = ["Patch", "PatchHandle", "PatchRegistry", "registry"]


def default_patches() -> list[Patch]:
    """Every audio patch mlxd ships (imported lazily: each module imports mlx-audio)."""
    from mlxd.engines.audio.patches import kokoro_conv

    return [kokoro_conv.PATCH]


registry = ProcessRegistry(default_patches)  # the audio patches (one per process)
