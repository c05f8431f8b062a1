"""What one request may send as images and videos, checked before any expensive work.

Every number is a ``ServerConfig`` field with a ``mlxd serve`` flag; the
defaults are close to what hosted APIs accept (OpenAI: 20 MB per image,
Anthropic: 8000 px per side) and what vLLM / llama-server users expect of a
local server (an 8K screenshot, a few minutes of video sampled at 2 fps as
Qwen2.5-VL's processor does).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.config import ServerConfig

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Per-item and per-request limits on images and videos."""

    image_bytes: int = 20 * MiB  # one encoded image
    video_bytes: int = 64 * MiB  # one encoded video
    request_bytes: int = 128 * MiB  # every image and video of a request together
    image_pixels: int = 33_177_600  # width x height (7680 x 4320, 8K UHD); video frames too
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
