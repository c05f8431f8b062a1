"""Uploaded audio -> mono float32 samples at the model's rate, through PyAV (no ffmpeg binary).

PyAV reads every container a client sends (wav, mp3, flac, m4a, ogg, webm...).
The header's sample rate, channels and duration are checked against
``AudioLimits`` before decoding, and the decoded length again while decoding,
so a file whose header lies stops at the limit instead of filling memory.
A file PyAV cannot open, one with no audio stream, or one that decodes to no
samples is a 400 that says so; a damaged stream decodes up to the damage.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxd.errors import InvalidRequest
from mlxd.media.audio_limits import AudioLimits

log = logging.getLogger(__name__)

WHISPER_RATE = 16_000


@dataclass(frozen=True)
class DecodedAudio:
    """A recording as mono float32 samples in [-1, 1] at ``sample_rate``."""

    samples: np.ndarray
    sample_rate: int
    source_rate: int  # as stored in the file
    source_channels: int
    codec: str

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def _bad_file(reason: str) -> InvalidRequest:
    return InvalidRequest(f"The uploaded file is not audio this server can decode: {reason}. "
                          "Send wav, mp3, flac, m4a, ogg or webm.", param="file",
                          code="invalid_audio")


def _open(data: bytes) -> Any:
    import av

    if not data:
        raise InvalidRequest("The uploaded file is empty (0 bytes).", param="file",
                             code="invalid_audio")
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, UnicodeDecodeError) as e:
        raise _bad_file(f"{type(e).__name__}: {e}") from None


def _header_seconds(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None


def decode_audio(data: bytes, limits: AudioLimits, rate: int = WHISPER_RATE) -> DecodedAudio:
    """Decode ``data`` to mono float32 at ``rate`` Hz, checking ``limits`` first (400s)."""
    import av

    container = _open(data)
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise _bad_file("it has no audio stream")
        codec = stream.codec_context
        limits.check_format(int(codec.sample_rate or 0), int(codec.channels or 0))
        header = _header_seconds(container, stream)
        if header is not None:
            limits.check_seconds(header)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks: list[np.ndarray] = []
        total, max_samples = 0, int(limits.seconds * rate) + rate
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    total += _append(chunks, out)
                if total > max_samples:
                    limits.check_seconds(total / rate)
            for out in resampler.resample(None):
                total += _append(chunks, out)
        except av.error.FFmpegError as e:
            if not chunks:
                raise _bad_file(f"{type(e).__name__}: {e}") from None
            # A truncated or damaged tail: keep what decoded, as players do.
            log.info("audio upload damaged after %.2f s (%s); using what decoded",
                     total / rate, e)
        name = codec.name or "unknown"
    if not total:
        raise InvalidRequest("The uploaded audio decodes to no samples (0 seconds).",
                             param="file", code="invalid_audio")
    samples = np.concatenate(chunks).astype(np.float32, copy=False)
    limits.check_seconds(len(samples) / rate)
    return DecodedAudio(samples, rate, int(codec.sample_rate), int(codec.channels), name)


def _append(chunks: list[np.ndarray], frame: Any) -> int:
    pcm = frame.to_ndarray().reshape(-1)  # packed "flt" mono: (1, n)
    chunks.append(pcm)
    return int(pcm.size)
