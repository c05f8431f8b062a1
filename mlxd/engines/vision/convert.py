"""Hugging Face VLM checkpoints saved by newer transformers, renamed for mlx-vlm's converter.

transformers 4.52+ saves vision-language models with the language model and the
vision tower under ``model.`` (``model.language_model.*``, ``model.visual.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``) and the head as
``lm_head``. mlx-vlm 0.7.10's ``sanitize`` expects the earlier names and
refuses the rest ("parameters not in model"). ``legacy_names`` writes a copy of
such a checkpoint with the earlier names (the layout is unchanged: only keys
move), which mlx-vlm then converts as usual; other checkpoints are left alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

NEW_PREFIXES = ("model.language_model.", "model.visual.", "model.vision_tower.",
                "model.multi_modal_projector.")
# Families whose earlier checkpoints keep the language model at the root (``model.*``).
QWEN_STYLE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def rename(key: str, model_type: str) -> str:
    """One weight's earlier name."""
    qwen = model_type in QWEN_STYLE
    if key.startswith("model.language_model."):
        rest = key[len("model.language_model."):]
        return f"model.{rest}" if qwen else f"language_model.model.{rest}"
    if key.startswith("lm_head.") and not qwen:
        return f"language_model.{key}"
    for prefix in ("model.visual.", "model.vision_tower.", "model.multi_modal_projector."):
        if key.startswith(prefix):
            return key[len("model."):]
    return key


def uses_new_names(src: Path) -> bool:
    """Whether any weight of the checkpoint in ``src`` has a newer transformers name."""
    from safetensors import safe_open

    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            if any(k.startswith(NEW_PREFIXES) for k in f.keys()):  # noqa: SIM118
                return True
    return False


def legacy_names(src: Path, dest: Path) -> Path:
    """``src`` itself when its names are the earlier ones, else a renamed copy in ``dest``."""
    import mlx.core as mx

    if not uses_new_names(src):
        return src
    model_type = str(json.loads((src / "config.json").read_text()).get("model_type", ""))
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") \
                and item.name != "model.safetensors.index.json":
            shutil.copy2(item, dest / item.name)
    for file in sorted(src.glob("*.safetensors")):
        weights, meta = cast(tuple[dict[str, Any], dict[str, str]],
                             mx.load(str(file), return_metadata=True))
        renamed = {rename(k, model_type): v for k, v in weights.items()}
        mx.save_safetensors(str(dest / file.name), renamed, metadata=meta or {"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k, model_type): v
                              for k, v in data.get("weight_map", {}).items()}
        (dest / index.name).write_text(json.dumps(data, indent=2))
    return dest
