"""Test audio made for real, offline: speech from espeak-ng (Debian's program) or the
Piper voice, containers written by PyAV, and the word error rate of a transcript."""

from __future__ import annotations

import io
import re
import shutil
import subprocess

import av
import numpy as np

SENTENCES = (
    "The weather is nice today.",
    "Please send the report by Friday.",
    "My favourite colour is blue.",
    "We will meet at the train station.",
    "Thank you for your help.",
)
SHORT = "Thank you for your help."


def espeak_wav(text: str) -> bytes:
    """``text`` spoken by espeak-ng, as the WAV file it writes (22.05 kHz mono)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (make setup installs it)")
    return subprocess.run([exe, "--stdout", text], check=True, capture_output=True).stdout


def encode(samples: np.ndarray, rate: int, fmt: str, codec: str,
           channels: int = 1, sample_fmt: str = "s16") -> bytes:
    """Mono float32 ``samples`` at ``rate`` written as ``fmt``/``codec`` (duplicated to
    ``channels``)."""
    layout = {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout
        pcm = np.clip(samples, -1, 1)
        planar = np.repeat((pcm * 32767).astype(np.int16)[None, :], channels, axis=0)
        frame = av.AudioFrame.from_ndarray(planar.T.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout,
                                      rate=rate)
        for f in resampler.resample(frame):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def decode(data: bytes, rate: int = 16_000) -> np.ndarray:
    """Any container -> mono float32 at ``rate`` (the test side's own decode)."""
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        out = [f.to_ndarray().reshape(-1) for frame in container.decode(audio=0)
               for f in resampler.resample(frame)]
    return np.concatenate(out)


def wav(samples: np.ndarray, rate: int = 16_000, channels: int = 1) -> bytes:
    return encode(samples, rate, "wav", "pcm_s16le", channels)


def mp3(samples: np.ndarray, rate: int = 16_000) -> bytes:
    return encode(samples, rate, "mp3", "libmp3lame")


def resample(samples: np.ndarray, rate: int, new_rate: int) -> np.ndarray:
    """Linear interpolation: enough to make a file of another sample rate."""
    n = int(len(samples) * new_rate / rate)
    return np.interp(np.arange(n) * rate / new_rate, np.arange(len(samples)),
                     samples).astype(np.float32)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("colour", "color")
                  .replace("favourite", "favorite")).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, case and punctuation
    ignored (British and American spellings of colour/favourite count as one)."""
    ref, hyp = words(reference), words(hypothesis)
    dist = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        prev, dist[0] = dist[0], i
        for j, h in enumerate(hyp, start=1):
            prev, dist[j] = dist[j], min(dist[j] + 1, dist[j - 1] + 1, prev + (r != h))
    return dist[len(hyp)] / max(1, len(ref))
