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


def header_seconds(data: bytes) -> float | None:
    """The duration the container's header states (None: it states none, or the file
    cannot be opened; ``decode_audio`` says why)."""
    try:
        container = _open(data)
    except InvalidRequest:
        return None
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        return _header_seconds(container, stream) if stream is not None else None


def decoded_bytes(seconds: float | None, limits: AudioLimits, rate: int = WHISPER_RATE) -> int:
    """Bytes ``decode_audio`` holds for a recording whose header says ``seconds`` (None:
    the longest the limits allow): one float32 buffer of the samples."""
    longest = limits.seconds if seconds is None else min(max(seconds, 0.0), limits.seconds)
    return 4 * (int(longest * rate) + rate)


def decode_audio(data: bytes, limits: AudioLimits, rate: int = WHISPER_RATE) -> DecodedAudio:
    """Decode ``data`` to mono float32 at ``rate`` Hz, checking ``limits`` first (400s).

    The samples go into one buffer sized from the header (grown, up to the limits, when
    the header is short of the truth), never a list of chunks plus their concatenation."""
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
        samples = _Samples(decoded_bytes(header, limits, rate) // 4,
                           int(limits.seconds * rate) + rate)
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    samples.append(out)
                if samples.size > samples.most:
                    limits.check_seconds(samples.size / rate)
            for out in resampler.resample(None):
                samples.append(out)
        except av.error.FFmpegError as e:
            if not samples.size:
                raise _bad_file(f"{type(e).__name__}: {e}") from None
            # A truncated or damaged tail: keep what decoded, as players do.
            log.info("audio upload damaged after %.2f s (%s); using what decoded",
                     samples.size / rate, e)
        name = codec.name or "unknown"
    if not samples.size:
        raise InvalidRequest("The uploaded audio decodes to no samples (0 seconds).",
                             param="file", code="invalid_audio")
    limits.check_seconds(samples.size / rate)
    return DecodedAudio(samples.result(), rate, int(codec.sample_rate), int(codec.channels),
                        name)


class _Samples:
    """A float32 buffer filled frame by frame, grown by half when full (past ``most``
    samples the caller refuses the recording)."""

    def __init__(self, capacity: int, most: int) -> None:
        self.buffer = np.empty(max(1, capacity), np.float32)
        self.size = 0
        self.most = most

    def append(self, frame: Any) -> None:
        pcm = frame.to_ndarray().reshape(-1)  # packed "flt" mono: (1, n)
        end = self.size + pcm.size
        if end > self.buffer.size:
            grown = np.empty(max(end, self.buffer.size * 3 // 2), np.float32)
            grown[:self.size] = self.buffer[:self.size]
            self.buffer = grown
        self.buffer[self.size:end] = pcm
        self.size = end

    def result(self) -> np.ndarray:
        """The samples; a copy when the buffer is much larger than them."""
        if self.size * 5 < self.buffer.size * 4:
            return self.buffer[:self.size].copy()
        return self.buffer[:self.size]
