"""``inspect`` reads quantisation from headers: MLX, GPTQ/AWQ, FP8, bitsandbytes; and the
hub download patterns per kind (no network: pure functions)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from mlxd.sources.hub import allow_patterns
from mlxd.sources.refs import SourceError
from mlxd.workflow.inspect import inspect_path

BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F8_E4M3": 1, "U8": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]],
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file with zero-filled tensors of the given dtypes and shapes."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = BYTES[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_folder(path: Path, config_extra: dict[str, Any],
                 tensors: dict[str, tuple[str, list[int]]],
                 metadata: dict[str, str] | None = None) -> Path:
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 1, "max_position_embeddings": 2048, **config_extra}
    (path / "config.json").write_text(json.dumps(config))
    write_safetensors(path / "model.safetensors", tensors, metadata)
    return path


def test_mlx_quantised_weights_are_counted_unpacked(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "mlx4", {"quantization": {"group_size": 64, "bits": 4}}, {
        "model.layers.0.mlp.up_proj.weight": ("U32", [128, 8]),
        "model.layers.0.mlp.up_proj.scales": ("F16", [128, 1]),
        "model.layers.0.mlp.up_proj.biases": ("F16", [128, 1]),
        "model.norm.weight": ("F16", [64])}, {"format": "mlx"})
    report = inspect_path(folder, hashes=False)
    assert report["format"] == "mlx" and report["mlx_format"] is True
    assert report["quantization"] == {"method": "mlx-affine", "bits": 4, "group_size": 64}
    assert report["parameters"] == 128 * 64 + 64
    assert report["needs_conversion"] is False


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_are_marked_and_left_to_mlx_lm(method: str, tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / method, {"quantization_config": {
        "quant_method": method, "bits": 4, "group_size": 128}}, {
        "model.layers.0.self_attn.q_proj.qweight": ("I32", [8, 64]),
        "model.layers.0.self_attn.q_proj.qzeros": ("I32", [1, 8]),
        "model.layers.0.self_attn.q_proj.scales": ("F16", [1, 64])})
    report = inspect_path(folder, hashes=False)
    assert report["quantization"]["method"] == method
    assert "gptq/awq packed weights (qweight)" in report["markers"]
    assert report["parameters"] == 8 * 64 * 8  # 32-bit words of eight 4-bit weights
    assert report["converter"] == "mlx-lm" and method.upper() in report["conversion_note"]


def test_fp8_weights_are_marked(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "fp8", {}, {
        "model.layers.0.mlp.down_proj.weight": ("F8_E4M3", [64, 64]),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", [1, 1])})
    report = inspect_path(folder, hashes=False)
    assert report["quantization"] == {"method": "fp8"}
    assert "fp8 weights" in report["markers"]
    assert report["dtypes"]["mlp"] == {"F32": 1, "F8_E4M3": 1}
    assert "FP8" in report["conversion_note"]


def test_bitsandbytes_is_refused_with_a_way_out(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "bnb", {"quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}},
        {"model.layers.0.mlp.up_proj.weight": ("U8", [64, 32])})
    report = inspect_path(folder, hashes=False)
    assert report["needs_conversion"] is True and report["converter"] is None
    assert "--quantize" in report["conversion_note"]


def test_vision_sub_config_is_summarised(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "vlm", {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32,
                          "image_size": 224, "patch_size": 14},
        "text_config": {"model_type": "llama", "hidden_size": 64}},
        {"vision_tower.patch_embedding.weight": ("F32", [32, 3, 14, 14])})
    report = inspect_path(folder, hashes=False)
    assert report["kind"] == "vision" and report["converter"] == "mlx-vlm"
    assert report["subconfigs"]["vision"] == {"model_type": "clip_vision_model",
                                              "hidden_size": 32, "image_size": 224,
                                              "patch_size": 14}
    assert report["dtypes"] == {"vision": {"F32": 1}}


def test_hub_download_patterns_follow_the_kind() -> None:
    files = ["config.json", "model.safetensors", "modules.json", "1_Pooling/config.json",
             "modeling_custom.py"]
    embedding = allow_patterns("embedding", files, None, trust_remote_code=False)
    assert "1_Pooling/*" in embedding and "*.py" not in embedding
    assert "*.py" in allow_patterns("text", files, None, trust_remote_code=True)


def test_a_gguf_only_repository_needs_one_file_named() -> None:
    files = ["README.md", "m.Q4_K_M.gguf", "m.Q8_0.gguf"]
    with pytest.raises(SourceError, match="choose one with --file"):
        allow_patterns("text", files, None, trust_remote_code=False)
    assert allow_patterns("text", files, "m.Q8_0.gguf", False)[0] == "m.Q8_0.gguf"
    with pytest.raises(SourceError, match=r"no file 'x\.gguf'"):
        allow_patterns("text", files, "x.gguf", False)
