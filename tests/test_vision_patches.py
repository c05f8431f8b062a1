"""mlx-vlm patches (issue 11 item 4): active only while a model of their family is loaded,
the upstream attributes restored (the same objects) after unload, and an unknown version
whose self-check fails refuses the model instead of guessing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_vision_families import tiny_vlms  # noqa: F401  (session fixture)

pytest.importorskip("mlx_vlm")


def load_engine(path: Path) -> Any:
    from mlxd.engines.text.engine import TextEngineOptions
    from mlxd.engines.vision.engine import MLXMultimodalLM
    from mlxd.runtime.worker import ModelWorker

    engine = MLXMultimodalLM(path.name, path, ModelWorker(path.name),
                             TextEngineOptions(max_num_seqs=2))
    engine.load()  # this thread stands in for the worker: nothing is stepped here
    return engine


def test_llava_patches_live_only_while_llava_is_loaded(tiny_vlms: dict[str, Path]) -> None:  # noqa: F811
    from mlx_vlm.models.llava.llava import Model
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from mlxd.engines.vision.patches import registry

    merge = Model.__dict__["_merge_input_ids_with_image_features"]
    missing = object()
    preprocess = CLIPImageProcessorPil.__dict__.get("preprocess", missing)
    qwen = load_engine(tiny_vlms["qwen2_vl"])
    assert registry().active() == []  # another family applies nothing
    first = load_engine(tiny_vlms["llava"])
    assert type(first.processor.image_processor) is CLIPImageProcessorPil
    assert CLIPImageProcessorPil.__dict__.get("preprocess", missing) is not preprocess
    assert Model.__dict__["_merge_input_ids_with_image_features"] is not merge
    assert registry().active() == ["llava-image-kwargs", "llava-merge-per-row"]
    second = load_engine(tiny_vlms["llava"])  # shared: one application, counted
    first.close()
    assert Model.__dict__["_merge_input_ids_with_image_features"] is not merge
    second.close()
    assert Model.__dict__["_merge_input_ids_with_image_features"] is merge
    assert CLIPImageProcessorPil.__dict__.get("preprocess", missing) is preprocess
    assert registry().active() == []
    qwen.close()


def test_merge_patch_keeps_each_rows_image() -> None:
    from mlxd.engines.vision.patches import llava_merge

    assert llava_merge.self_check()  # upstream still mixes rows up; ours does not


def test_unknown_version_with_a_failing_self_check_refuses_the_model() -> None:
    from mlxd.engines.vision.patches import Patch, PatchRegistry
    from mlxd.errors import ModelLoadError

    class Owner:
        attr = "upstream"

    original = Owner.__dict__["attr"]
    patch = Patch("p", frozenset({"fam"}), {"mlx-vlm": ("0.7.10",)},
                  targets=lambda m, p: [(Owner, "attr", "patched")],
                  self_check=lambda m, p: False)
    known = PatchRegistry([patch], version=lambda d: "0.7.10")
    handle = known.activate("fam", "m", (None, None))
    assert Owner.attr == "patched"
    handle.undo()
    assert Owner.__dict__["attr"] is original
    unknown = PatchRegistry([patch], version=lambda d: "9.9")
    with pytest.raises(ModelLoadError, match="refusing the model"):
        unknown.activate("fam", "m", (None, None))
    assert Owner.__dict__["attr"] is original
    passing = PatchRegistry([Patch("p", frozenset({"fam"}), {"mlx-vlm": ("0.7.10",)},
                                   targets=lambda m, p: [(Owner, "attr", "patched")],
                                   self_check=lambda m, p: True)], version=lambda d: "9.9")
    passing.activate("fam", "m", (None, None)).undo()  # warns, applies, undoes
    assert Owner.__dict__["attr"] is original


@pytest.mark.parametrize(("family", "key"), [("gemma3", "image_seq_length"),
                                             ("smolvlm", "image_seq_len")])
def test_a_processor_image_count_unlike_the_models_is_refused_at_load(
        tiny_vlms: dict[str, Path], tmp_path: Path, family: str, key: str) -> None:  # noqa: F811
    import json
    import shutil

    from mlxd.errors import ModelLoadError

    folder = shutil.copytree(tiny_vlms[family], tmp_path / family)
    config = json.loads((folder / "processor_config.json").read_text())
    config[key] = 9  # the model takes 4
    (folder / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{key}=9, but the model takes 4"):
        load_engine(folder)
