"""Converting Hugging Face VLM checkpoints (issue 11 item 1): one saved by newer transformers
(``model.language_model.*``, ``model.visual.*``, ``lm_head``), which mlx-vlm's converter
refuses, converts to the same MLX weights as the same checkpoint under the earlier names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")


def newer_names(src: Path, dest: Path, family: str) -> Path:
    """``src`` (earlier HF names) re-saved under transformers 4.52+ names."""
    import mlx.core as mx

    shutil.copytree(src, dest)
    qwen = family.startswith("qwen")
    out = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if qwen and key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
        elif key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith("language_model.lm_head"):
            key = key[len("language_model."):]
        elif key.startswith(("visual.", "vision_tower.", "multi_modal_projector.")):
            key = "model." + key
        out[key] = value
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_newer_transformers_names_convert_like_the_earlier_ones(session_dir: Path,
                                                                tmp_path: Path,
                                                                family: str) -> None:
    import mlx.core as mx
    from mlx_vlm import load

    from mlxd.engines.mlx_convert import run_converter
    from mlxd.engines.vision.convert import uses_new_names
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"
    earlier = build_tiny_vlm(family, root / f"{family}-hf", root / "tokenizers", hf_format=True)
    newer = newer_names(earlier, tmp_path / "newer", family)
    assert uses_new_names(newer) and not uses_new_names(earlier)
    run_converter("mlx-vlm", earlier, tmp_path / "a", dtype="float32")
    run_converter("mlx-vlm", newer, tmp_path / "b", dtype="float32")
    a = mx.load(str(tmp_path / "a" / "model.safetensors"))
    b = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    load(str(tmp_path / "b"))  # mlx-vlm loads the result
    assert not list(tmp_path.glob(".renamed-*"))  # the scratch copy is gone
