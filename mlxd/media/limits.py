"""What one request may send as images and videos, checked before any expensive work.

Every number is a ``ServerConfig`` field with a ``mlxd serve`` flag; the
defaults are close to what hosted APIs accept (OpenAI: 20 MB per image,
Anthropic: 8000 px per side) and what vLLM / llama-server users expect of a
local server (an 8K screenshot, a few minutes of video sampled at 2 fps as
Qwen2.5-VL's processor does).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from mlxd.config import ServerConfig
from mlxd.errors import PayloadTooLarge
from mlxd.media.types import ImageInput, VideoInput

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Per-item and per-request limits on images and videos."""

    image_bytes: int = 20 * MiB  # one encoded image
    video_bytes: int = 64 * MiB  # one encoded video
    request_bytes: int = 128 * MiB  # every image and video of a request together
    image_pixels: int = 33_177_600  # width x height (7680 x 4320, 8K UHD); video frames too
    request_pixels: int = 132_710_400  # decoded pixels of every image and sampled frame
    images_per_request: int = 32
    videos_per_request: int = 4
    video_seconds: float = 300.0  # duration in the container header
    video_frames: int = 18_000  # frames in the container header (5 min at 60 fps)
    video_fps: float = 2.0  # frames sampled per second of video
    video_max_frames: int = 64  # frames sampled at most (spread evenly when fewer fit)
    fetch_timeout: float = 10.0  # seconds for one remote fetch, redirects included
    allow_private_urls: bool = False  # fetch from private / loopback / link-local hosts

    @classmethod
    def from_config(cls, config: ServerConfig) -> MediaLimits:
        """The limits a server runs with (its ``--max-image-bytes`` ... flags)."""
        return cls(
            image_bytes=config.max_image_bytes, video_bytes=config.max_video_bytes,
            request_bytes=config.max_media_bytes, image_pixels=config.max_image_pixels,
            request_pixels=config.max_media_pixels,
            images_per_request=config.max_images_per_request,
            videos_per_request=config.max_videos_per_request,
            video_seconds=config.max_video_seconds, video_frames=config.max_video_frames,
            video_fps=config.video_fps, video_max_frames=config.video_max_frames,
            fetch_timeout=config.media_fetch_timeout,
            allow_private_urls=config.allow_private_media_urls)


def human_bytes(n: int) -> str:
    """``20 MiB`` / ``512 KiB`` / ``17 bytes``: sizes in error messages."""
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} bytes"


class PixelBudget:
    """Decoded pixels every image and sampled video frame of one request may take together
    (413 past it); taken from the image headers before decoding, on worker threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int, param: str) -> None:
        with self._lock:
            self.used += n
            over = self.used > self.limit
        if over:
            raise PayloadTooLarge(
                f"The images and video frames of this request exceed {self.limit} decoded "
                f"pixels together (at {param}; --max-media-pixels).", param=param,
                code="media_too_many_pixels")


# What a vision engine holds while it prepares a prompt (engines/vision/input.py): each image
# is decoded at full size (RGBA at most: 4 bytes a pixel) one at a time, then scaled down
# to what its processor uses (Qwen2-VL's default 1280 x 28 x 28 pixels, kept at up to
# twice each side), and the processor holds RGB, its own uint8 copy and float32 pixel
# values (about 16 bytes a pixel), as it does for every sampled video frame.
FULL_DECODE_BYTES_PER_PIXEL = 4
PREPARED_BYTES_PER_PIXEL = 16
FITTED_IMAGE_PIXELS = 4 * 1280 * 28 * 28


def prepared_media_bytes(items: Iterable[ImageInput | VideoInput]) -> int:
    """Bytes preparing a prompt with ``items`` holds at its peak (an estimate)."""
    largest = prepared = 0
    for item in items:
        if isinstance(item, ImageInput):
            pixels = item.width * item.height
            largest = max(largest, pixels)
            prepared += min(pixels, FITTED_IMAGE_PIXELS)
        else:
            prepared += sum(int(f.shape[0]) * int(f.shape[1]) for f in item.frames)
    return FULL_DECODE_BYTES_PER_PIXEL * largest + PREPARED_BYTES_PER_PIXEL * prepared
