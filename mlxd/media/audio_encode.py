"""Encode synthesised speech (mono 16-bit PCM) into OpenAI's speech formats, as it comes.

mp3, opus (in Ogg), aac (ADTS), flac and wav go through PyAV's bundled FFmpeg
libraries (no system ffmpeg); each ``encode`` call returns the bytes the muxer
has produced so far, so a response streams while later sentences are still
being synthesised. ``pcm`` is raw signed 16-bit little-endian at 24 kHz, as
OpenAI documents it; the other formats keep the model's rate when the codec
allows it and are resampled (PyAV's resampler) when it does not.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import numpy as np

SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac",
               "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}
PCM_RATE = 24_000  # OpenAI's ``pcm``: 24 kHz, mono, s16le, no header
# (container, codec, sample rates the codec takes: None means any)
_CODECS: dict[str, tuple[str, str, tuple[int, ...] | None]] = {
    "mp3": ("mp3", "libmp3lame", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
    "opus": ("ogg", "libopus", (8000, 12000, 16000, 24000, 48000)),
    "aac": ("adts", "aac", None),
    "flac": ("flac", "flac", None),
}


class SpeechEncoder(Protocol):
    def encode(self, pcm: bytes) -> bytes:
        """Bytes ready to send after this much more audio."""

    def finish(self) -> bytes:
        """The last bytes (flushes the codec, writes the trailer)."""


def pick_rate(rate: int, allowed: tuple[int, ...] | None) -> int:
    """``rate`` itself if the codec takes it, else the nearest allowed rate above it."""
    if allowed is None or rate in allowed:
        return rate
    higher = [r for r in allowed if r >= rate]
    return min(higher) if higher else max(allowed)


class _Sink:
    """A write-only file PyAV muxes into; ``take()`` hands over what is there."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


def _frame(pcm: bytes, rate: int) -> Any:
    import av

    samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = rate
    return frame


class CodecEncoder:
    """mp3 / opus / aac / flac through a PyAV container writing into memory."""

    def __init__(self, fmt: str, rate: int) -> None:
        import av

        container, codec, rates = _CODECS[fmt]
        self.rate = rate
        self.out_rate = pick_rate(rate, rates)
        self._sink = _Sink()
        # Ogg holds a page back until it spans page_duration (default 1 s): 20 ms lets each
        # sentence's audio leave as soon as it is encoded.
        options = {"page_duration": "20000"} if container == "ogg" else {}
        self._out = av.open(self._sink, mode="w", format=container, options=options)
        self._stream: Any = self._out.add_stream(codec, rate=self.out_rate, layout="mono")
        ctx: Any = self._stream.codec_context
        ctx.open()  # frame_size is known once the codec is open
        sample_fmt = ctx.codec.audio_formats[0].name
        self._resampler = av.AudioResampler(format=sample_fmt, layout="mono",
                                            rate=self.out_rate, frame_size=ctx.frame_size or None)
        self._pts = 0

    def _mux(self, frames: list[Any]) -> None:
        for frame in frames:
            frame.pts = self._pts
            self._pts += frame.samples
            self._out.mux(self._stream.encode(frame))

    def encode(self, pcm: bytes) -> bytes:
        if pcm:
            self._mux(self._resampler.resample(_frame(pcm, self.rate)))
        return self._sink.take()

    def finish(self) -> bytes:
        self._mux(self._resampler.resample(None))
        self._out.mux(self._stream.encode(None))
        self._out.close()
        return self._sink.take()


class PcmEncoder:
    """Raw s16le at ``PCM_RATE`` (resampled with PyAV when the model's rate differs)."""

    def __init__(self, rate: int) -> None:
        import av

        self.rate = rate
        self._resampler = (None if rate == PCM_RATE else
                           av.AudioResampler(format="s16", layout="mono", rate=PCM_RATE))

    def _bytes(self, frames: list[Any]) -> bytes:
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)

    def encode(self, pcm: bytes) -> bytes:
        if self._resampler is None or not pcm:
            return pcm
        return self._bytes(self._resampler.resample(_frame(pcm, self.rate)))

    def finish(self) -> bytes:
        return b"" if self._resampler is None else self._bytes(self._resampler.resample(None))


def wav_header(rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header; ``data_bytes`` None (streaming): sizes left at maximum,
    which readers take as "until the end of the stream"."""
    data = 0xFFFFFFFF - 36 if data_bytes is None else data_bytes
    return (b"RIFF" + struct.pack("<I", data + 36) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


class WavEncoder:
    """16-bit mono WAV at the model's rate; the header goes out with the first bytes."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._started = False

    def encode(self, pcm: bytes) -> bytes:
        if self._started:
            return pcm
        self._started = True
        return wav_header(self.rate, None) + pcm

    def finish(self) -> bytes:
        return b"" if self._started else wav_header(self.rate, None)


def speech_encoder(fmt: str, rate: int) -> SpeechEncoder:
    """A streaming encoder for ``fmt`` (one of ``SPEECH_FORMATS``) of ``rate`` Hz input."""
    if fmt == "pcm":
        return PcmEncoder(rate)
    if fmt == "wav":
        return WavEncoder(rate)
    if fmt in _CODECS:
        return CodecEncoder(fmt, rate)
    raise ValueError(f"unknown speech format {fmt!r}; expected one of {', '.join(SPEECH_FORMATS)}")


def encode_speech(pcm: bytes, rate: int, fmt: str) -> bytes:
    """A whole recording in ``fmt`` (wav gets exact sizes in its header)."""
    if fmt == "wav":
        return wav_header(rate, len(pcm)) + pcm
    encoder = speech_encoder(fmt, rate)
    return encoder.encode(pcm) + encoder.finish()
