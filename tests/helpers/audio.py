"""Test audio made for real, offline: speech from espeak-ng (Debian's program) or the
Piper voice, containers written by PyAV, and the word error rate of a transcript."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

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


def build_tiny_moonshine(folder: Path, seed: int = 0) -> Path:
    """A random-weight Moonshine (mlx-audio's own architecture, tiny sizes) saved as a
    Hugging Face checkpoint is: ``model.``-prefixed names, conv weights (out, in, k)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.moonshine.config import ModelConfig
    from mlx_audio.stt.models.moonshine.moonshine import Model

    config = {"model_type": "moonshine", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "encoder_num_hidden_layers": 1,
              "decoder_num_hidden_layers": 1, "encoder_num_attention_heads": 2,
              "decoder_num_attention_heads": 2, "max_position_embeddings": 64}
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if "conv" in name and name.endswith("weight") and value.ndim == 3:
            value = mx.transpose(value, (0, 2, 1))
        weights["model." + name] = value
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
