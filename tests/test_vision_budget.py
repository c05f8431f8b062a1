"""Vision models under the one memory budget (issue 11 item 5): the estimate is weights +
KV reserve + the image-feature cache + the vision tower's peak on the largest image."""

from __future__ import annotations

from mlxd.models.memory import (
    FEATURE_CACHE_BYTES,
    estimate_memory,
    vision_activation_bytes,
)
from mlxd.models.spec import ModelKind

QWEN2_VL_2B = {  # the published Qwen2-VL-2B-Instruct config's sizes
    "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vision_config": {"embed_dim": 1280, "num_heads": 16,
                                                "mlp_ratio": 4, "patch_size": 14}}
LLAVA = {"text_config": {"hidden_size": 4096, "num_hidden_layers": 32,
                         "num_attention_heads": 32},
         "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "image_size": 336,
                           "patch_size": 14, "num_attention_heads": 16}}


def test_vision_reserve_adds_feature_cache_and_tower_peak_to_the_text_reserve() -> None:
    for config in (QWEN2_VL_2B, LLAVA):
        text = estimate_memory(ModelKind.TEXT, 10**9, config)
        vision = estimate_memory(ModelKind.VISION, 10**9, config)
        peak = vision_activation_bytes(config)
        assert peak > 0
        assert vision.reserve == text.reserve + FEATURE_CACHE_BYTES + peak


def test_tower_peak_follows_the_image_size() -> None:
    # llava's tower takes 336 x 336 always: 576 patches, whatever the pixel limit
    assert vision_activation_bytes(LLAVA, 10**8) == vision_activation_bytes(LLAVA, 10**4)
    # qwen2-vl's takes what the processor gives: more pixels, more patches
    assert vision_activation_bytes(QWEN2_VL_2B, 4 * 10**6) > \
        vision_activation_bytes(QWEN2_VL_2B, 10**6)
    assert vision_activation_bytes({"hidden_size": 64}) == 0  # no tower: nothing added
