"""llava: merge each row's image features into its own row.

mlx-vlm's ``llava.Model._merge_input_ids_with_image_features`` takes the image
positions of row 0 only (``np.where(ids == image)[1]``) and writes the
features of every image at those columns in every row: with several rows,
each holding an image, every row but the last gets another row's image (8
colours in one batch came back as one colour). mlxd embeds each request
alone, so this guards any batched embedding path and ``mlx_vlm`` calls made
while the model is loaded. The replacement gathers the k-th image token's
feature row for the k-th image position in row-major order.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from mlxd.engines.upstream.patching import Patch


def merge_per_row(self: Any, image_features: mx.array, inputs_embeds: mx.array,
                  input_ids: mx.array) -> mx.array:
    """``inputs_embeds`` with the image features at the image-token positions of each row."""
    hidden = image_features.shape[-1]
    is_image = input_ids == self.config.image_token_index  # (B, L)
    flat = image_features.reshape(-1, hidden).astype(inputs_embeds.dtype)
    positions = int(is_image.astype(mx.int32).sum().item())
    if positions != flat.shape[0]:
        raise ValueError(f"The prompt has {positions} image tokens for {flat.shape[0]} "
                         "image features.")
    order = mx.maximum(mx.cumsum(is_image.reshape(-1).astype(mx.int32)) - 1, 0)
    gathered = flat[order].reshape(inputs_embeds.shape)
    return mx.where(is_image[..., None], gathered, inputs_embeds)


def _model_class() -> Any:
    from mlx_vlm.models.llava.llava import Model

    return Model


def targets(model: Any, processor: Any) -> list[tuple[Any, str, Any]]:
    return [(_model_class(), "_merge_input_ids_with_image_features", merge_per_row)]


def self_check(model: Any = None, processor: Any = None) -> bool:
    """Two rows, two different images: upstream must still mix them up (else the patch
    is not needed: refuse to guess) and the replacement must keep them apart."""
    fake = SimpleNamespace(config=SimpleNamespace(image_token_index=7))
    ids = mx.array([[1, 7, 7, 2], [1, 7, 7, 2]])
    feats = mx.array([[[1.0], [2.0]], [[3.0], [4.0]]])
    want = [[0.0, 1.0, 2.0, 0.0], [0.0, 3.0, 4.0, 0.0]]
    ours = merge_per_row(fake, feats, mx.zeros((2, 4, 1)), ids)[..., 0].tolist()
    try:
        upstream = _model_class()._merge_input_ids_with_image_features(
            fake, feats, mx.zeros((2, 4, 1)), ids)[..., 0].tolist()
    except Exception:  # upstream refuses the batch: the patch is still the fix
        upstream = None
    return bool(ours == want and upstream != want)


PATCH = Patch(
    name="llava-merge-per-row", families=frozenset({"llava"}),
    checked={"mlx-vlm": ("0.7.10",)}, targets=targets, self_check=self_check,
    why="llava's image-feature merge gives every row the last row's image positions")
