"""``python -m bench.audio [--quick]``: speech to text through mlxd's HTTP API vs raw mlx-whisper.

STT: Whisper tiny.en (the starter wheel, converted once to float32 by mlxd) transcribes
the same recording -- the Piper starter voice speaking a few sentences through mlxd's own
``/v1/audio/speech``, repeated to ``seconds`` -- three ways:

- ``mlxd``: ``POST /v1/audio/transcriptions`` (json) to ``mlxd serve``, one request at a time;
- ``raw mlx-whisper``: ``mlx_whisper.transcribe`` on the same samples and folder, float32,
  in its own process (``--raw-worker``), with the same environment (same BLAS);
- ``vllm-mlx 0.6.0``: not run: its transcription endpoint accepts only an allowlist of
  Hugging Face ids (``whisper-large-v3`` ... ``parakeet``, resolved to ``mlx-community/*``
  and downloaded on first use) and refuses a local folder, so it cannot serve Whisper
  offline; the result says so.

Each contender gets one warm-up pass, then ``repeats`` timed passes, alternating between
the contenders; the median counts. The figure is x realtime (seconds of audio per second of wall time) and mlxd's ratio to raw.
Results: ``bench/results/<tag>.json`` and ``<tag>.md`` (tag ``audio`` / ``audio-quick``).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from bench.servers import (
    ServerProcess,
    ServerSpec,
    free_port,
    machine,
    subprocess_env,
    write_report,
)
from mlxd.models.starter import STARTER_STT, STARTER_TTS

REPO = Path(__file__).resolve().parent.parent
STT_MODEL = STARTER_STT.name
VOICE_MODEL = STARTER_TTS.name
# Sentences that do not repeat: a window that repeats its text trips Whisper's
# compression-ratio check and sends it into random temperature fallbacks.
TEXT = ("The weather is nice today. Please send the report by Friday. My favourite colour "
        "is blue. We will meet at the train station. Thank you for your help. The library "
        "opens at nine in the morning. Our team finished the new bridge design last week. "
        "She plays the violin in a small orchestra. The museum has a large collection of old "
        "maps. Remember to water the garden before you leave. The train to the coast was "
        "late again. He bought fresh bread and cheese at the market. The children built a "
        "castle out of sand. Coffee tastes better when the beans are freshly ground. The "
        "storm knocked down two trees near the school. We need more chairs for the meeting "
        "room. The river froze for the first time in ten years. Please turn off the lights "
        "when you go. The old clock in the hall still keeps good time. Our neighbours are "
        "moving to a farm in the north.")


@dataclass(frozen=True)
class Sizes:
    seconds: float = 60.0  # length of the recording transcribed
    repeats: int = 3


FULL = Sizes()
QUICK = Sizes(seconds=20.0, repeats=1)


# -- the recording -------------------------------------------------------------------------

def decode_16k(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16_000)
        return np.concatenate([f.to_ndarray().reshape(-1) for frame in
                               container.decode(audio=0) for f in resampler.resample(frame)])


def recording(http: httpx.Client, seconds: float) -> np.ndarray:
    """The Piper voice speaking TEXT (through mlxd), repeated with 0.5 s gaps to ``seconds``."""
    r = http.post("/v1/audio/speech", json={"model": VOICE_MODEL, "voice": "joe", "input": TEXT,
                                            "response_format": "wav"})
    r.raise_for_status()
    speech = np.concatenate([decode_16k(r.content), np.zeros(8_000, np.float32)])
    reps = max(1, int(np.ceil(seconds * 16_000 / len(speech))))
    return np.tile(speech, reps)[:int(seconds * 16_000)]


def wav_bytes(samples: np.ndarray) -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


# -- contenders ----------------------------------------------------------------------------

def timed(fn: Any, repeats: int) -> tuple[list[float], str]:
    text = fn()  # warm-up (first-call compilation, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        text = fn()
        times.append(time.perf_counter() - t0)
    return times, text


def run_mlxd(http: httpx.Client, audio: bytes, repeats: int) -> tuple[list[float], str]:
    def once() -> str:
        r = http.post("/v1/audio/transcriptions", data={"model": STT_MODEL},
                      files={"file": ("speech.wav", audio, "audio/wav")})
        r.raise_for_status()
        return str(r.json()["text"])

    return timed(once, repeats)


def raw_worker(folder: str, samples_path: str, repeats: int, out: str) -> int:
    """``--raw-worker``: mlx_whisper.transcribe on the samples, float32, as mlxd calls it."""
    import mlx_whisper

    samples = np.load(samples_path)

    def once() -> str:
        return str(mlx_whisper.transcribe(samples, path_or_hf_repo=folder, fp16=False,
                                          language="en")["text"]).strip()

    times, text = timed(once, repeats)
    Path(out).write_text(json.dumps({"times": times, "text": text}))
    return 0


def run_raw(folder: Path, samples: np.ndarray, repeats: int,
            env: dict[str, str]) -> tuple[list[float], str]:
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "a.npy", samples)
        out = Path(tmp) / "raw.json"
        subprocess.run([sys.executable, "-m", "bench.audio", "--raw-worker", str(folder),
                        str(Path(tmp) / "a.npy"), str(repeats), str(out)],
                       env=env, check=True, cwd=REPO)
        result = json.loads(out.read_text())
    return result["times"], result["text"]


def converted_whisper(home: Path) -> Path:
    """The float32 mlx-whisper folder mlxd converted (the STT starter's first load made it)."""
    found = sorted((home / "models" / "converted").glob("whisper-*-float32"))
    if not found:
        raise SystemExit(f"no converted Whisper under {home}/models/converted")
    return found[0]


# -- the run -------------------------------------------------------------------------------

def stt(args: argparse.Namespace, sizes: Sizes, env: dict[str, str]) -> dict[str, Any]:
    """STT x realtime: mlxd over HTTP vs raw mlx-whisper on the same recording."""
    port = free_port()
    registry = args.out / "audio-models.yaml"  # the two audio starters only: no chat preload
    registry.write_text(yaml.safe_dump({"models": [STARTER_STT.public(), STARTER_TTS.public()]}))
    spec = ServerSpec("mlxd", (sys.executable, "-m", "mlxd", "serve", "--host", "127.0.0.1",
                               "--port", str(port), "--home", str(args.home),
                               "--models-config", str(registry), "--log-level", "warning",
                               "--blas", args.blas), STT_MODEL, "/health")
    mlxd_times: list[float] = []
    raw_times: list[float] = []
    with ServerProcess(spec, port, env, args.out / "logs" / "audio-mlxd.log"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800,
                         trust_env=False) as http:
        upload = wav_bytes(recording(http, sizes.seconds))
        # raw gets exactly the samples mlxd decodes from the upload (16-bit, then float32)
        samples = decode_16k(upload)
        # Passes alternate (mlxd, raw, mlxd, raw...) so a busy neighbour hits both alike;
        # each raw pass is its own process with its own warm-up pass.
        for _ in range(sizes.repeats):
            times, mlxd_text = run_mlxd(http, upload, 1)
            mlxd_times += times
            times, raw_text = run_raw(converted_whisper(args.home), samples, 1, env)
            raw_times += times
    seconds = len(samples) / 16_000
    medians = {"mlxd": statistics.median(mlxd_times),
               "raw mlx-whisper": statistics.median(raw_times)}
    rows: dict[str, dict[str, Any]] = {
        name: {"median_s": medians[name], "x_realtime": seconds / medians[name],
               "runs_s": t, "text_head": text[:80]}
        for name, (t, text) in {"mlxd": (mlxd_times, mlxd_text),
                                "raw mlx-whisper": (raw_times, raw_text)}.items()}
    return {"audio_seconds": seconds, "contenders": rows,
            "mlxd_vs_raw": medians["raw mlx-whisper"] / medians["mlxd"],
            "same_text": mlxd_text == raw_text,
            "vllm-mlx": "not run: vllm-mlx 0.6.0's /v1/audio/transcriptions accepts only its "
                        "allowlist of Hugging Face ids (mlx-community/whisper-*, parakeet), "
                        "downloaded on first use, and refuses a local folder: no offline "
                        "Whisper"}


def markdown(results: dict[str, Any]) -> str:
    s = results["stt"]
    lines = [f"# Speech to text ({s['audio_seconds']:.0f} s of Piper speech, Whisper tiny.en "
             "float32)", "", f"Machine: {results['machine'].get('cpu')}, "
             f"{results['machine'].get('blas')}", "",
             "| contender | median s | x realtime |", "|---|---:|---:|"]
    for name, row in s["contenders"].items():
        lines.append(f"| {name} | {row['median_s']:.2f} | {row['x_realtime']:.2f} |")
    lines += ["", f"mlxd / raw: **{s['mlxd_vs_raw']:.2f}x** (same text: {s['same_text']})",
              "", f"vllm-mlx: {s['vllm-mlx']}", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.audio", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--raw-worker"]:
        return raw_worker(argv[1], argv[2], int(argv[3]), argv[4])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else FULL
    env, blas = subprocess_env(args.blas)
    results: dict[str, Any] = {"machine": {**machine(args.blas, ("mlx", "mlx-whisper")),
                                           "blas": blas}}
    results["stt"] = stt(args, sizes, env)
    tag = "audio-quick" if args.quick else "audio"
    write_report(args.out, tag, results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
