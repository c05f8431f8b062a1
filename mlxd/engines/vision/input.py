"""Prompt preparation for vision-language models (the vision ``InputProcessor``).

The server has already resolved every image or video part of the messages
into ``{"type": "image", "image": ImageInput}`` / ``{"type": "video", "video":
VideoInput}`` (``mlxd/media/types.py``): fetched, size-checked and probed. Here
each part becomes its chat template's placeholder, the rendered prompt goes
through the model's Hugging Face processor (which expands every placeholder to
the image's patch tokens and computes pixel values), and the result is a
``VisionPrompt``: the expanded token ids, the media items in prompt order (with
their hashes, for the prefix and feature caches) and the processor's arrays as
NumPy, turned into MLX arrays only on the model's worker thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from mlxd.engines.text.input_processor import InputProcessor, MediaItem, PreparedPrompt
from mlxd.errors import InvalidRequest
from mlxd.generation.chat import content_text, unreadable_part
from mlxd.generation.params import GenerationRequest
from mlxd.media.types import IMAGE_PART, VIDEO_PART, ImageInput, VideoInput, resolved_media

TEXT_PARTS = ("text", "input_text", "output_text")
# Parts the HTTP side must have resolved before a vision model sees them.
UNRESOLVED = ("image_url", "input_image", "video_url")


@dataclass
class VisionPrompt(PreparedPrompt):
    """A prepared prompt plus the processor's arrays for its images and videos."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class VisionInputProcessor(InputProcessor):
    """``InputProcessor`` for a vision-language model: keeps image and video parts."""

    def __init__(self, *args: Any, processor: Any, prepare_kwargs: dict[str, Any],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.processor = processor
        self.prepare_kwargs = prepare_kwargs
        self.fit = processor_fit(processor)

    # -- message content -----------------------------------------------------
    def content(self, content: Any, where: str) -> Any:
        """Text parts as text, resolved images and videos as template placeholders."""
        if not isinstance(content, list):
            return content_text(content, where=where)
        parts: list[dict[str, Any]] = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS:
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == IMAGE_PART and isinstance(part.get("image"), ImageInput):
                parts.append({"type": "image"})
            elif kind == VIDEO_PART and isinstance(part.get("video"), VideoInput):
                parts.append({"type": "video"})
            elif kind in UNRESOLVED or kind in (IMAGE_PART, VIDEO_PART):
                raise InvalidRequest(f"The '{kind}' part was not resolved to an image or video.",
                                     param=where)
            else:
                raise unreadable_part(kind, where, "a vision-language model")
        return parts

    def media_of(self, messages: list[dict[str, Any]]) -> tuple[MediaItem, ...]:
        """Every resolved image and video in prompt order, each with its content hash."""
        return tuple(
            MediaItem("image", item.sha256, data=item.data) if isinstance(item, ImageInput)
            else MediaItem("video", item.sha256, ref=f"video:{len(item.frames)}")
            for item in resolved_media(messages))

    # -- the stage -----------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """The base preparation, then the processor's expansion of the media placeholders."""
        base = super().prepare(request)
        images, videos, fps = _decoded_media(request.messages or [], self.fit)
        if not images and not videos:
            return base
        arrays = self._process(base.prompt_text, images, videos, fps)
        tokens = [int(t) for t in arrays.pop("input_ids")[0].tolist()]
        arrays.pop("attention_mask", None)
        limit = self._check_limits(len(tokens), request.max_tokens)
        values = {f.name: getattr(base, f.name) for f in fields(PreparedPrompt)}
        values.update(tokens=tokens, max_tokens=limit.tokens,
                      context_limited=limit.context_limited)
        return VisionPrompt(**values, arrays=arrays)

    def tokenize(self, request: GenerationRequest, add_special_tokens: bool) -> list[int]:
        """The base tokenisation; a chat with images or videos is expanded by the model's
        processor as ``prepare`` expands it, so the count equals a chat's prompt tokens.
        The media were resolved and checked against the limits before this runs."""
        tokens = super().tokenize(request, add_special_tokens)
        images, videos, fps = _decoded_media(request.messages or [], self.fit)
        if not images and not videos:
            return tokens
        text, _, _ = self._render_chat(request)
        arrays = self._process(text, images, videos, fps)
        tokens = [int(t) for t in arrays["input_ids"][0].tolist()]
        if len(tokens) >= self.limits.context_length:
            raise self._too_long(f"your prompt has {len(tokens)} tokens", "messages",
                                 tokens=len(tokens), counted=True)
        return tokens

    def _process(self, text: str, images: list[Any], videos: list[Any],
                 fps: list[float] | None = None) -> dict[str, np.ndarray]:
        """Run the model's processor on one prompt (never batched: gemma3's refuses that).

        ``fps`` is the rate each video's frames were sampled at: the processor places
        frames in time with it (qwen2.5-vl's ``second_per_grid_ts``); without it mlx-vlm
        assumes its default rate."""
        from mlx_vlm.utils import prepare_inputs

        extra: dict[str, Any] = {"fps": list(fps)} if videos and fps else {}
        try:
            out = prepare_inputs(self.processor, images=images or None, videos=videos or None,
                                 prompts=text, return_tensors="np", **self.prepare_kwargs,
                                 **extra)
        except (ValueError, TypeError, OSError) as e:
            raise InvalidRequest(f"The model's processor could not read the media: {e}",
                                 param="messages") from e
        return {k: np.asarray(v) for k, v in dict(out).items() if v is not None}


def _decoded_media(messages: list[dict[str, Any]], fit: ImageFit | None = None
                   ) -> tuple[list[Any], list[Any], list[float]]:
    """PIL images, frame lists and each video's sampled fps, in prompt order. Each image
    is decoded and scaled by ``fit`` before the next is read, so at most one full-size
    copy exists at a time."""
    images: list[Any] = []
    videos: list[Any] = []
    fps: list[float] = []
    for item in resolved_media(messages):
        if isinstance(item, ImageInput):
            images.append(decode_image(item, fit))
        else:
            videos.append([np.asarray(f) for f in item.frames])
            fps.append(float(item.fps))
    return images, videos, fps


# (width, height) -> the size to decode an image at (never larger than it is)
ImageFit = Callable[[int, int], tuple[int, int]]
# An image is scaled down before the processor only when it is more than this many times
# (per side) larger than what the processor makes of it, and then to this many times that:
# ordinary images reach the processor untouched (its own resize gives the reference
# pixels), a 8K screenshot for a 448 px tower does not hold 100 MB per image.
FIT_MARGIN = 2.0


def processor_fit(processor: Any) -> ImageFit | None:
    """How large an image the model's image processor can use, from its configuration:
    Qwen-style ``max_pixels``, or ``size`` as height x width (resized to exactly that),
    longest edge or shortest edge. None: a processor this does not know (no scaling)."""
    ip = getattr(processor, "image_processor", None)
    if ip is None:
        return None
    max_pixels = getattr(ip, "max_pixels", None)
    size = getattr(ip, "size", None)

    def get(key: str) -> int:
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        return int(value) if isinstance(value, int | float) and value > 0 else 0

    if isinstance(max_pixels, int | float) and max_pixels > 0:
        def scale(w: int, h: int) -> float:
            return math.sqrt(float(max_pixels) / (w * h))
    elif get("height") and get("width"):
        def scale(w: int, h: int) -> float:
            return max(get("width") / w, get("height") / h)
    elif get("longest_edge"):
        def scale(w: int, h: int) -> float:
            return get("longest_edge") / max(w, h)
    elif get("shortest_edge"):
        def scale(w: int, h: int) -> float:
            return get("shortest_edge") / min(w, h)
    else:
        return None

    def fit(width: int, height: int) -> tuple[int, int]:
        factor = scale(width, height) * FIT_MARGIN
        if factor >= 1.0:
            return width, height
        return (min(width, max(1, round(width * factor))),
                min(height, max(1, round(height * factor))))

    return fit


def decode_image(image: ImageInput, fit: ImageFit | None = None) -> Any:
    """The image as an RGB PIL image, scaled down to ``fit``'s size if that is smaller
    (the HTTP side probed it; decoding can still fail)."""
    from PIL import Image

    from mlxd.media.images import pillow_openers

    try:
        with Image.open(io.BytesIO(image.data), formats=pillow_openers()) as im:
            size = fit(im.width, im.height) if fit is not None else im.size
            if size != im.size:
                im.draft("RGB", size)  # JPEG: decode at a reduced scale directly
                src = im if im.mode in ("RGB", "L") else im.convert("RGB")
                return src.resize(size, Image.Resampling.BICUBIC,
                                  reducing_gap=3.0).convert("RGB")
            return im.convert("RGB")
    except Exception as e:  # PIL raises many kinds for damaged data
        raise InvalidRequest(f"The image could not be decoded: {e}", param="messages") from e
