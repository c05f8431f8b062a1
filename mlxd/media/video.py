"""Videos as clients send them, decoded with PyAV (FFmpeg in the wheel: no system ffmpeg).

The container header is read first and the duration, frame count and frame
size are checked against the limits before any frame is decoded; decoding
re-checks them (a header can lie) and stops at the first breach.

Sampling: one frame every ``1 / fps`` seconds from the start (frame times as
the container stamps them), or, when the video is longer than
``max_frames / fps`` seconds, ``max_frames`` frames spread evenly over it.
Sampled frames larger than ``FRAME_PIXELS`` are scaled down (aspect kept):
vision processors resize video frames far below that anyway, and 64 full 8K
frames would take 6 GB.
"""

from __future__ import annotations

import hashlib
import io
import math
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.media.limits import MediaLimits, human_bytes
from mlxd.media.types import VideoInput

FRAME_PIXELS = 1280 * 720  # largest sampled frame handed to an engine


def sample_times(seconds: float, fps: float, max_frames: int) -> list[float]:
    """The times (seconds) to take frames at: every 1/fps, or max_frames spread evenly."""
    count = max(1, math.floor(seconds * fps + 1e-9))
    if count <= max_frames:
        return [i / fps for i in range(count)]
    step = seconds / max_frames
    return [(i + 0.5) * step for i in range(max_frames)]


def sampled_fps(seconds: float, fps: float, max_frames: int) -> float:
    """The rate frames are sampled at: ``fps``, or lower when max_frames spread evenly."""
    if math.floor(seconds * fps + 1e-9) > max_frames:
        return max_frames / seconds
    return fps


def _header(container: Any, param: str, limits: MediaLimits) -> tuple[Any, float]:
    """The video stream and its duration, refused on the header's numbers."""
    if not container.streams.video:
        raise InvalidRequest(f"{param} has no video stream.", param=param, code="invalid_video")
    stream = container.streams.video[0]
    seconds = 0.0
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / 1_000_000  # av.time_base: microseconds
    if seconds > limits.video_seconds:
        raise InvalidRequest(f"{param} is {seconds:.1f} s long; the limit is "
                             f"{limits.video_seconds:g} s.", param=param, code="video_too_long")
    frames = int(stream.frames or 0)
    if frames > limits.video_frames:
        raise InvalidRequest(f"{param} has {frames} frames; the limit is {limits.video_frames}.",
                             param=param, code="video_too_long")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.image_pixels:
        raise InvalidRequest(f"{param} frames have more than {limits.image_pixels} pixels "
                             f"({width} x {height}).", param=param, code="video_too_large")
    return stream, seconds


def _scaled(frame: Any) -> Any:
    """The frame as RGB, scaled down to at most FRAME_PIXELS (aspect kept)."""
    pixels = frame.width * frame.height
    if pixels <= FRAME_PIXELS:
        return frame.to_ndarray(format="rgb24")
    scale = math.sqrt(FRAME_PIXELS / pixels)
    width = max(2, int(frame.width * scale) // 2 * 2)
    height = max(2, int(frame.height * scale) // 2 * 2)
    return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()


def _sample(container: Any, stream: Any, seconds: float, param: str,
            limits: MediaLimits) -> list[Any]:
    """Decode in order, keeping the first frame at or after each sample time."""
    # header without a duration: sample at fps until the seconds limit
    times = sample_times(seconds or limits.video_seconds, limits.video_fps,
                         limits.video_max_frames)
    picked: list[Any] = []
    for count, frame in enumerate(container.decode(stream), start=1):
        t = float(frame.time) if frame.time is not None else (count - 1) / limits.video_fps
        if count > limits.video_frames or t > limits.video_seconds:
            raise InvalidRequest(f"{param} is longer than its header says and over the "
                                 "limits.", param=param, code="video_too_long")
        if frame.width * frame.height > limits.image_pixels:
            raise InvalidRequest(f"{param} frames have more than {limits.image_pixels} pixels.",
                                 param=param, code="video_too_large")
        if len(picked) < len(times) and t + 1e-6 >= times[len(picked)]:
            picked.append(_scaled(frame))
    return picked


def decode_video(data: bytes, param: str, limits: MediaLimits,
                 source: str = "data") -> VideoInput:
    """Sampled RGB frames of an encoded video (any container and codec FFmpeg reads)."""
    import av  # the vision extra; imported when a video arrives

    if len(data) > limits.video_bytes:
        raise InvalidRequest(f"{param} is larger than {human_bytes(limits.video_bytes)}.",
                             param=param, code="media_too_large")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream, seconds = _header(container, param, limits)
            stream.thread_type = "AUTO"
            frames = _sample(container, stream, seconds, param, limits)
    except InvalidRequest:
        raise
    except Exception:  # any demuxer/decoder failure on client bytes is a 400
        raise InvalidRequest(f"{param} is not a video FFmpeg can read.", param=param,
                             code="invalid_video") from None
    if not frames:
        raise InvalidRequest(f"{param} has no frames.", param=param, code="invalid_video")
    height, width = frames[0].shape[:2]
    return VideoInput(sha256=hashlib.sha256(data).hexdigest(), frames=tuple(frames),
                      fps=sampled_fps(seconds, limits.video_fps, limits.video_max_frames),
                      seconds=seconds, width=int(width),
                      height=int(height), source=source)
