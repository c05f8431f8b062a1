"""llava: keep tokenizer kwargs away from the transformers-5 image processor.

mlx-vlm's ``LlavaProcessor.__call__`` passes every kwarg (``padding``,
``padding_side``, ``add_special_tokens``) to both the tokenizer and the image
processor; transformers 5 validates image kwargs strictly and raises
"ImagesKwargs.__init__() got an unexpected keyword argument 'padding'", so no
llava request with an image can be prepared. While a llava model is loaded,
its image processor's class drops the kwargs it does not declare.
"""

from __future__ import annotations

from typing import Any

from mlxd.engines.upstream.patching import Patch


def _filtering(original: Any) -> Any:
    def preprocess(self: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        allowed = set(getattr(self, "_valid_kwargs_names", None) or ())
        if allowed:
            kwargs = {k: v for k, v in kwargs.items() if k in allowed or k == "return_tensors"}
        return original(self, images, *args, **kwargs)

    preprocess.__wrapped__ = original  # type: ignore[attr-defined]
    return preprocess


def targets(model: Any, processor: Any) -> list[tuple[Any, str, Any]]:
    cls = type(processor.image_processor)
    return [(cls, "preprocess", _filtering(cls.preprocess))]


def self_check(model: Any, processor: Any) -> bool:
    """The image processor must still refuse ``padding`` (else the patch is not needed),
    and accept the call once the kwargs are filtered."""
    from PIL import Image

    ip = processor.image_processor
    image = Image.new("RGB", (8, 8))
    try:
        ip(image, padding=True)
        return False
    except (TypeError, ValueError):
        pass
    try:
        _filtering(type(ip).preprocess)(ip, image, padding=True)
    except Exception:
        return False
    return True


PATCH = Patch(
    name="llava-image-kwargs", families=frozenset({"llava"}),
    checked={"mlx-vlm": ("0.7.10",), "transformers": ("5.24.0",)}, targets=targets,
    self_check=self_check,
    why="mlx-vlm's LlavaProcessor passes tokenizer kwargs to a strict image processor")
