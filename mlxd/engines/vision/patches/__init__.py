"""Narrow, reversible fixes to mlx-vlm, applied only while a model of their family is loaded.

One module here per patch (the llava family's merge and processor arguments); the
machinery that checks versions, self-checks, reference-counts and undoes them is
``engines/upstream/patching.py``.
"""

from __future__ import annotations

from mlxd.engines.upstream.patching import Patch, PatchHandle, PatchRegistry, ProcessRegistry

__all__ = ["Patch", "PatchHandle", "PatchRegistry", "registry"]


def default_patches() -> list[Patch]:
    """Every patch mlxd ships (imported lazily: each module imports mlx-vlm)."""
    from mlxd.engines.vision.patches import llava_merge, llava_processor_kwargs

    return [llava_merge.PATCH, llava_processor_kwargs.PATCH]


registry = ProcessRegistry(default_patches)  # the vision patches
