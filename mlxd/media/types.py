"""The resolved media a request carries from the HTTP side to an engine.

The server resolves every image or video part of a chat request (fetch or
decode the data: URL, check the limits, probe the size) before it leases a
model, and replaces the part in the canonical messages with one of:

- ``{"type": "image", "image": ImageInput}``
- ``{"type": "video", "video": VideoInput}``

A vision engine's input processor turns those into its chat template's
placeholders and pixel values; ``sha256`` keys the prefix and feature caches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageInput:
    """One image, still encoded as the client sent it (PNG, JPEG, WebP, ...)."""

    sha256: str  # of ``data``
    data: bytes
    width: int
    height: int
    format: str  # PIL's name for it: "PNG", "JPEG", ...
    source: str = "data"  # "data" (inline) or the URL it was fetched from

    def __repr__(self) -> str:  # never dump the bytes into logs
        return (f"ImageInput({self.format} {self.width}x{self.height}, "
                f"{len(self.data)} bytes, sha256={self.sha256[:12]})")


@dataclass(frozen=True)
class VideoInput:
    """A video as the frames sampled from it, in order (RGB uint8, H x W x 3)."""

    sha256: str  # of the encoded video as sent
    frames: tuple[Any, ...] = field(repr=False)  # numpy.ndarray each
    fps: float  # the rate the frames were sampled at
    seconds: float  # duration of the source video
    width: int
    height: int
    source: str = "data"


IMAGE_PART = "image"
VIDEO_PART = "video"


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
