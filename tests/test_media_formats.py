"""Every documented image and video format is accepted (issue 31 item 9).

docs/vision.md promises PNG, JPEG (and MPO), WebP, GIF and BMP images and any
video FFmpeg reads. Each file here is written at test time by Pillow or PyAV,
sent as a data: URL, resolved as a request's media are, and decoded as a vision
engine decodes it. Pillow 13 dropped its separate "MPO" opener, and asking
``Image.open`` for a format it has no opener for refused every format but PNG
and JPEG.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlxd.engines.vision.input import decode_image
from mlxd.media.limits import MediaLimits
from mlxd.media.resolve import resolve_media
from tests.helpers.media_samples import data_url, image, image_part, video, video_part

MIME = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg", "WEBP": "webp", "GIF": "gif",
        "BMP": "bmp"}
# (container, codec, pixel format, mime): the common containers and codecs of the web
VIDEOS = [("mp4", "mpeg4", "yuv420p", "mp4"), ("mp4", "libx264", "yuv420p", "mp4"),
          ("webm", "libvpx", "yuv420p", "webm"), ("webm", "libvpx-vp9", "yuv420p", "webm"),
          ("matroska", "libx264", "yuv420p", "x-matroska"),
          ("mov", "mjpeg", "yuvj420p", "quicktime"), ("avi", "mpeg4", "yuv420p", "x-msvideo")]


def resolved(part: dict[str, Any]) -> Any:
    messages = [{"role": "user", "content": [part]}]
    out = asyncio.run(resolve_media(messages, MediaLimits()))
    resolved_part = out[0]["content"][0]
    return resolved_part[resolved_part["type"]]


@pytest.mark.parametrize("fmt", list(MIME))
def test_every_documented_image_format_is_read_and_decoded(fmt: str) -> None:
    data = image(fmt, 40, 30, (30, 160, 90))
    item = resolved(image_part(data_url(data, f"image/{MIME[fmt]}")))
    assert (item.width, item.height) == (40, 30)
    assert item.format in ({"JPEG", "MPO"} if fmt in ("JPEG", "MPO") else {fmt})
    rgb = decode_image(item)
    assert rgb.mode == "RGB" and rgb.size == (40, 30)
    r, g, b = rgb.getpixel((20, 15))
    assert abs(r - 30) < 12 and abs(g - 160) < 12 and abs(b - 90) < 12, (r, g, b)


@pytest.mark.parametrize("container,codec,pix_fmt,mime", VIDEOS,
                         ids=[f"{c}-{k}" for c, k, _, _ in VIDEOS])
def test_common_video_containers_and_codecs_are_sampled(container: str, codec: str,
                                                         pix_fmt: str, mime: str) -> None:
    data = video(seconds=1.0, fps=8, container_format=container, codec=codec,
                 pix_fmt=pix_fmt)
    clip = resolved(video_part(data_url(data, f"video/{mime}")))
    assert (clip.width, clip.height) == (64, 48) and len(clip.frames) == 2
    greys = [int(f.mean()) for f in clip.frames]  # frames 0 and 4 (at 0 s and 0.5 s)
    assert abs(greys[0] - 0) <= 8 and abs(greys[1] - 32) <= 8, greys
