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
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from mlxd.engines.text.input_processor import InputProcessor, MediaItem, PreparedPrompt
from mlxd.errors import InvalidRequest
from mlxd.generation.chat import content_text
from mlxd.generation.params import GenerationRequest
from mlxd.media.types import IMAGE_PART, VIDEO_PART, ImageInput, VideoInput

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
                raise InvalidRequest(f"Unsupported content part type: {kind!r}", param=where)
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
        images, videos, fps = _decoded_media(request.messages or [])
        if not images and not videos:
            return base
        arrays = self._process(base.prompt_text, images, videos, fps)
        tokens = [int(t) for t in arrays.pop("input_ids")[0].tolist()]
        arrays.pop("attention_mask", None)
        max_tokens = self._check_limits(len(tokens), request.max_tokens)
        values = {f.name: getattr(base, f.name) for f in fields(PreparedPrompt)}
        values.update(tokens=tokens, max_tokens=max_tokens)
        return VisionPrompt(**values, arrays=arrays)

    def tokenize(self, request: GenerationRequest, add_special_tokens: bool) -> list[int]:
        """The base tokenisation; a chat with images or videos is expanded by the model's
        processor as ``prepare`` expands it, so the count equals a chat's prompt tokens.
        The media were resolved and checked against the limits before this runs."""
        tokens = super().tokenize(request, add_special_tokens)
        images, videos, fps = _decoded_media(request.messages or [])
        if not images and not videos:
            return tokens
        text, _, _ = self._render_chat(request)
        arrays = self._process(text, images, videos, fps)
        tokens = [int(t) for t in arrays["input_ids"][0].tolist()]
        if len(tokens) >= self.limits.context_length:
            raise self._too_long(f"your prompt has {len(tokens)} tokens", "messages")
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


def resolved_media(messages: list[dict[str, Any]]) -> Iterator[ImageInput | VideoInput]:
    """The resolved images and videos of ``messages``, in prompt order."""
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            image, video = part.get("image"), part.get("video")
            if isinstance(image, ImageInput):
                yield image
            elif isinstance(video, VideoInput):
                yield video


def _decoded_media(messages: list[dict[str, Any]]
                   ) -> tuple[list[Any], list[Any], list[float]]:
    """PIL images, frame lists and each video's sampled fps, in prompt order."""
    images: list[Any] = []
    videos: list[Any] = []
    fps: list[float] = []
    for item in resolved_media(messages):
        if isinstance(item, ImageInput):
            images.append(decode_image(item))
        else:
            videos.append([np.asarray(f) for f in item.frames])
            fps.append(float(item.fps))
    return images, videos, fps


def decode_image(image: ImageInput) -> Any:
    """The image as an RGB PIL image (the HTTP side probed it; decoding can still fail)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(image.data)) as im:
            return im.convert("RGB")
    except Exception as e:  # PIL raises many kinds for damaged data
        raise InvalidRequest(f"The image could not be decoded: {e}", param="messages") from e
