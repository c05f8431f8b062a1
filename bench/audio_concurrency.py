"""``python -m bench.audio_concurrency [--quick]``: speech under concurrent load, mlxd over HTTP.

- STT: ``clients`` uploads of ``stt_seconds`` of Piper speech each (different stretches
  of ``TEXT``, so no two windows are the same), sent one at a time, then all
  at once; the figure is aggregate audio seconds transcribed per wall second, and the
  ratio of concurrent to one-at-a-time (batched uploads share the model's window batches,
  ``engines/audio/stt_window_batcher.py``; target at least 2x). The engine's
  ``mlxd_speech_shared_batches_total`` shows the sharing happened.
- TTS: ``clients`` requests of the same multi-sentence text, one at a time, then all at
  once (streamed mp3): aggregate audio seconds per wall second, and the median time to
  the first audio bytes of a request alone and of each of the concurrent ones.

One ``mlxd serve`` with the two audio starters; one warm-up of each kind first.
Results: ``bench/results/<tag>.json`` and ``<tag>.md`` (tag ``audio-concurrency`` /
``audio-concurrency-quick``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.audio import decode_16k, wav_bytes
from bench.audio_tts import SENTENCES, speak_streamed, speak_wav
from bench.servers import machine, mlxd_audio_server, subprocess_env, write_report
from mlxd.models.starter import STARTER_STT, STARTER_TTS

REPO = Path(__file__).resolve().parent.parent
STT_MODEL = STARTER_STT.name
TTS_MODEL = STARTER_TTS.name
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
    clients: int = 4
    stt_seconds: float = 60.0  # each upload
    tts_copies: int = 2  # the five sentences, this many times, per request


FULL = Sizes()
QUICK = Sizes(clients=2, stt_seconds=32.0, tts_copies=1)  # just over one window: batched


def uploads(http: httpx.Client, sizes: Sizes) -> list[bytes]:
    """``clients`` recordings of ``stt_seconds``: the Piper voice reading TEXT once, cut
    into consecutive stretches (repeated when the text runs out), 0.5 s gaps kept."""
    r = http.post("/v1/audio/speech", json={"model": TTS_MODEL, "voice": "joe", "input": TEXT,
                                            "response_format": "wav"})
    r.raise_for_status()
    speech = decode_16k(r.content)
    n = int(sizes.stt_seconds * 16_000)
    whole = np.tile(speech, int(np.ceil(n * sizes.clients / len(speech))) + 1)
    return [wav_bytes(whole[i * n:(i + 1) * n]) for i in range(sizes.clients)]


def transcribe(http: httpx.Client, audio: bytes) -> float:
    """Wall seconds of one transcription (batched: the uploads are over 30 s)."""
    started = time.perf_counter()
    r = http.post("/v1/audio/transcriptions", data={"model": STT_MODEL},
                  files={"file": ("speech.wav", audio, "audio/wav")})
    r.raise_for_status()
    return time.perf_counter() - started


def shared_batches(http: httpx.Client) -> float:
    name = f'mlxd_speech_shared_batches_total{{model="{STT_MODEL}"}}'
    line = next((x for x in http.get("/metrics").text.splitlines() if x.startswith(name)), "")
    return float(line.split()[-1]) if line else 0.0


def at_once(fn: Any, items: list[Any]) -> tuple[float, list[Any]]:
    """Wall seconds for ``fn`` on every item in its own thread, and the results."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(items)) as pool:
        out = list(pool.map(fn, items))
    return time.perf_counter() - started, out


def stt(http: httpx.Client, sizes: Sizes) -> dict[str, Any]:
    files = uploads(http, sizes)
    transcribe(http, files[0])  # warm-up
    audio_s = sizes.stt_seconds * len(files)
    started = time.perf_counter()
    for f in files:
        transcribe(http, f)
    serial_s = time.perf_counter() - started
    shared = shared_batches(http)
    concurrent_s, _ = at_once(lambda f: transcribe(http, f), files)
    return {"uploads": len(files), "seconds_each": sizes.stt_seconds,
            "one_at_a_time_s": serial_s, "concurrent_s": concurrent_s,
            "one_at_a_time_audio_s_per_s": audio_s / serial_s,
            "concurrent_audio_s_per_s": audio_s / concurrent_s,
            "speed_up": serial_s / concurrent_s,
            "shared_batches": shared_batches(http) - shared}


def tts(http: httpx.Client, sizes: Sizes) -> dict[str, Any]:
    text = " ".join(SENTENCES * sizes.tts_copies)
    speak_wav(http, SENTENCES[0])  # load the voice
    audio_each = speak_wav(http, text)[1]
    alone = [speak_streamed(http, text) for _ in range(sizes.clients)]
    serial_s = sum(total for _, total in alone)
    concurrent_s, together = at_once(lambda t: speak_streamed(http, t), [text] * sizes.clients)
    audio_s = audio_each * sizes.clients
    return {"requests": sizes.clients, "characters_each": len(text),
            "audio_s_each": audio_each, "one_at_a_time_s": serial_s,
            "concurrent_s": concurrent_s,
            "one_at_a_time_audio_s_per_s": audio_s / serial_s,
            "concurrent_audio_s_per_s": audio_s / concurrent_s,
            "speed_up": serial_s / concurrent_s,
            "ttfa_alone_s": statistics.median(f for f, _ in alone),
            "ttfa_concurrent_s": statistics.median(f for f, _ in together),
            "ttfa_concurrent_max_s": max(f for f, _ in together)}


def run(args: argparse.Namespace, sizes: Sizes, env: dict[str, str]) -> dict[str, Any]:
    with mlxd_audio_server("audio-concurrency", [STARTER_STT, STARTER_TTS], home=args.home,
                           out=args.out, blas=args.blas, env=env) as (_, http):
        return {"stt": stt(http, sizes), "tts": tts(http, sizes)}


def markdown(results: dict[str, Any]) -> str:
    s, t = results["stt"], results["tts"]
    return "\n".join([
        "# Speech under concurrent load (mlxd over HTTP, Whisper tiny.en float32, Piper joe)",
        "", f"Machine: {results['machine'].get('cpu')}, {results['machine'].get('blas')}", "",
        f"STT: {s['uploads']} uploads of {s['seconds_each']:.0f} s", "",
        "| | wall s | audio s / s |", "|---|---:|---:|",
        f"| one at a time | {s['one_at_a_time_s']:.1f} | {s['one_at_a_time_audio_s_per_s']:.2f} |",
        f"| all at once | {s['concurrent_s']:.1f} | {s['concurrent_audio_s_per_s']:.2f} |", "",
        f"Concurrent / one at a time: **{s['speed_up']:.2f}x** (target 2x); shared batches: "
        f"{s['shared_batches']:.0f}", "",
        f"TTS: {t['requests']} streamed mp3 requests of {t['characters_each']} characters "
        f"({t['audio_s_each']:.1f} s of audio each)", "",
        "| | wall s | audio s / s | first audio s (median) |", "|---|---:|---:|---:|",
        f"| one at a time | {t['one_at_a_time_s']:.1f} | "
        f"{t['one_at_a_time_audio_s_per_s']:.2f} | {t['ttfa_alone_s']:.2f} |",
        f"| all at once | {t['concurrent_s']:.1f} | {t['concurrent_audio_s_per_s']:.2f} | "
        f"{t['ttfa_concurrent_s']:.2f} (max {t['ttfa_concurrent_max_s']:.2f}) |", "",
        f"Concurrent / one at a time: **{t['speed_up']:.2f}x** (Piper sentences are not "
        "batched: see docs/audio.md)", ""])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.audio_concurrency",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else FULL
    env, blas = subprocess_env(args.blas)
    results: dict[str, Any] = {"machine": {**machine(args.blas, ("mlx", "mlx-whisper")),
                                           "blas": blas}, "sizes": asdict(sizes)}
    results.update(run(args, sizes, env))
    write_report(args.out, "audio-concurrency-quick" if args.quick else "audio-concurrency",
                 results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
