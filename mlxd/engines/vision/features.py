"""Input embeddings for one vision request, and the image-feature cache behind them.

The vision tower is the expensive part of a vision prompt. Its output (the
projected image features, in the language model's space) depends only on the
pixels, so it is cached under the hashes of the request's images: turn 2 of a
conversation about the same image passes the cached features to mlx-vlm's
``get_input_embeddings(cached_image_features=...)`` and skips the tower. The
families whose tower mlxd knows how to call alone are listed in ``ENCODERS``;
the others run the tower every time (correct, just not cached).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.engines.text.input_processor import PreparedPrompt

Encoder = Callable[[Any, mx.array, dict[str, mx.array]], mx.array]


def _qwen(model: Any, pixels: mx.array, extra: dict[str, mx.array]) -> mx.array:
    grid = extra.get("image_grid_thw")
    if grid is None:
        grid = extra.get("video_grid_thw")
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixels.astype(dtype), grid, output_hidden_states=False)


def _gemma3(model: Any, pixels: mx.array, extra: dict[str, mx.array]) -> mx.array:
    dtype = model.language_model.model.embed_tokens.weight.dtype
    hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype),
                                      output_hidden_states=True)
    return model.multi_modal_projector(hidden)


def _llava(model: Any, pixels: mx.array, extra: dict[str, mx.array]) -> mx.array:
    *_, hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    layer = model.vision_feature_layer
    if isinstance(layer, int):
        selected = hidden[layer]
        if model.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
    else:
        pool = [hidden[i] for i in layer]
        if model.vision_feature_select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        selected = mx.concatenate(pool, axis=-1)
    return model.multi_modal_projector(selected)


ENCODERS: dict[str, Encoder] = {"qwen2_vl": _qwen, "qwen2_5_vl": _qwen, "gemma3": _gemma3,
                                "llava": _llava}
# Prompt kwargs the language model must not get: gemma3's 4-D mask is a padding
# mask with no causal part (the generator builds the causal one itself).
DROPPED = ("attention_mask_4d",)


class FeatureCache:
    """Image features by the hashes of a request's images, bounded by bytes (LRU)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, ...], mx.array] = OrderedDict()
        self._lock = threading.Lock()  # nbytes is read from other threads
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.tower_runs = 0  # prompts whose images went through the vision tower

    def get(self, key: tuple[str, ...]) -> mx.array | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: tuple[str, ...], features: mx.array) -> None:
        size = int(features.nbytes)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= int(old.nbytes)
            while self._items and self.nbytes + size > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.nbytes -= int(evicted.nbytes)
            self._items[key] = features
            self.nbytes += size

    def __len__(self) -> int:
        return len(self._items)


def embed_prompt(model: Any, model_type: str, prompt: PreparedPrompt,
                 cache: FeatureCache | None) -> dict[str, Any]:
    """The generator's prompt kwargs for one request: ``inputs_embeds`` and what the
    family adds (qwen's M-RoPE positions); text-only prompts too."""
    ids = mx.array([prompt.tokens])
    arrays = getattr(prompt, "arrays", None) or {}
    if "pixel_values" not in arrays and "pixel_values_videos" not in arrays:
        return _kwargs(model.get_input_embeddings(ids, None))
    pixels = mx.array(arrays["pixel_values"] if "pixel_values" in arrays
                      else arrays["pixel_values_videos"])
    extra = {k: mx.array(v) for k, v in arrays.items()
             if k not in ("pixel_values", "pixel_values_videos")}
    extra.setdefault("mask", mx.ones(ids.shape, mx.int32))
    encoder = ENCODERS.get(model_type)
    if encoder is not None and cache is not None and prompt.media:
        key = (model_type, *prompt.media_hashes)
        features = cache.get(key)
        if features is None:
            features = encoder(model, pixels, extra)
            mx.eval(features)
            cache.put(key, features)
            cache.tower_runs += 1
        extra["cached_image_features"] = features
    elif cache is not None:  # get_input_embeddings runs the tower itself
        cache.tower_runs += 1
    return _kwargs(model.get_input_embeddings(ids, pixels, **extra))


def _kwargs(features: Any) -> dict[str, Any]:
    out = {k: v for k, v in features.to_dict().items() if v is not None and k not in DROPPED}
    mx.eval(list(out.values()))
    return out
