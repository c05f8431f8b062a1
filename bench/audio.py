"""``python -m bench.audio [--quick]``: long-form speech to text, mlxd batched vs sequential vs
raw mlx-whisper, with the word error rate of each.

STT: Whisper tiny.en (the starter wheel, converted once to float32 by mlxd) transcribes
recordings of 60 s and 600 s (``--quick``: 20 s and 60 s). Each recording is the Piper
starter voice speaking sentences made by ``sentences()`` (a seeded grammar of everyday
words; none is a sentence of the tests), one ``/v1/audio/speech`` request per sentence
through mlxd itself, with a silence of 0.3-1.5 s (seeded) after each, so the reference
text is known exactly. Three contenders:

- ``mlxd batched``: ``POST /v1/audio/transcriptions`` with ``chunking_strategy=auto``:
  cut at the pauses, windows decoded as one batch (docs/audio.md);
- ``mlxd sequential``: the same with ``chunking_strategy=sequential``: mlx-whisper's
  window-after-window loop inside mlxd;
- ``raw mlx-whisper``: ``mlx_whisper.transcribe`` on the samples mlxd decodes from the
  upload, float32, as mlxd calls it, in its own process (``--raw-worker``, one per pass)
  with the same environment (same BLAS).

Every contender is warmed up first on the recording's first ``WARMUP_S`` seconds (the
server once per mode, each raw process itself), then runs ``repeats`` timed passes; the
order of the contenders turns round each repeat, and the median counts. Per recording:
x realtime (seconds of audio per second of wall time), the ratio to raw, the word error
rate against the reference (``tests.helpers.audio.word_error_rate``), and CPU seconds
(mlxd: the server process and its children over the request; raw: its worker process).
The issue's targets (batched at least 0.95x raw on 60 s and 2x on 600 s; batched WER
within 1 point of sequential) are marked met or not.

vllm-mlx 0.6.0 is not run: its transcription endpoint accepts only an allowlist of
Hugging Face ids and refuses a local folder, so it cannot serve Whisper offline.
Results: ``bench/results/<tag>.json`` and ``<tag>.md`` (tag ``audio`` / ``audio-quick``).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.servers import cpu_seconds, machine, mlxd_audio_server, subprocess_env, write_report
from mlxd.models.starter import STARTER_STT, STARTER_TTS
from tests.helpers.audio import word_error_rate

REPO = Path(__file__).resolve().parent.parent
STT_MODEL = STARTER_STT.name
VOICE_MODEL = STARTER_TTS.name
RATE = 16_000
WARMUP_S = 10.0
GAP_S = (0.3, 1.5)  # silence after each sentence, drawn from this range
SEED = 0
BATCHED, SEQUENTIAL, RAW = "mlxd batched", "mlxd sequential", "raw mlx-whisper"
STRATEGY = {BATCHED: "auto", SEQUENTIAL: "sequential"}
# The speed targets: batched / raw at least this, by recording length (s).
TARGET_VS_RAW = {60.0: 0.95, 600.0: 2.0}
TARGET_WER_POINTS = 1.0  # batched WER at most this many points above sequential

# A sentence is SUBJECT ACTION PLACE TIME. No digits, no spelling that differs between
# British and American English, no contractions: the word error rate measures hearing.
SUBJECTS = ("The farmer", "My uncle", "Our teacher", "A young pilot", "The baker",
            "Her brother", "The old captain", "A quiet student", "The new doctor",
            "The tall gardener", "A tired driver", "My cousin", "The mayor", "A busy nurse",
            "The fisherman", "Their daughter")
ACTIONS = ("carried a heavy box", "painted the wooden gate", "found a silver key",
           "cooked a simple dinner", "repaired the broken window", "wrote a long letter",
           "bought a warm jacket", "cleaned the kitchen floor", "opened a small shop",
           "lost an umbrella", "planted some apple trees", "read a strange story",
           "sold fresh vegetables", "waited for the last bus", "fed the hungry ducks",
           "sang an old song")
PLACES = ("near the harbor", "in the village square", "behind the post office",
          "at the edge of the forest", "beside the quiet lake", "on the top floor",
          "outside the old church", "across the busy road", "in a narrow street",
          "under the stone bridge", "at the airport", "by the river", "next to the bakery",
          "inside the train station", "at the foot of the hill", "in the public garden")
TIMES = ("on a cold morning", "before lunch", "after the storm", "late in the evening",
         "during the holidays", "last summer", "early on Sunday", "before the guests arrived",
         "while it was raining", "after a long day", "in the spring", "at sunset",
         "on a windy afternoon", "just after midnight", "before the market closed",
         "when the snow melted")


@dataclass(frozen=True)
class Sizes:
    lengths: tuple[tuple[float, int], ...] = ((60.0, 3), (600.0, 1))  # (seconds, repeats)


FULL = Sizes()
QUICK = Sizes(lengths=((20.0, 1), (60.0, 1)))


# -- the recordings ------------------------------------------------------------------------

def sentences(seed: int = SEED) -> Iterator[str]:
    """Different sentences of the grammar above, in an order fixed by ``seed`` (the first
    n are the same whatever comes after them)."""
    parts = (SUBJECTS, ACTIONS, PLACES, TIMES)
    total = int(np.prod([len(p) for p in parts]))
    rng, seen = random.Random(seed), set[int]()
    while len(seen) < total:
        index = rng.randrange(total)
        if index in seen:
            continue
        seen.add(index)
        words = []
        for p in reversed(parts):
            index, i = divmod(index, len(p))
            words.append(p[i])
        yield " ".join(reversed(words)) + "."


def decode_16k(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
        return np.concatenate([f.to_ndarray().reshape(-1) for frame in
                               container.decode(audio=0) for f in resampler.resample(frame)])


def wav_bytes(samples: np.ndarray) -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@dataclass
class Recording:
    seconds: float  # as asked (its samples are exactly this long)
    samples: np.ndarray
    reference: str  # the sentences spoken, in order
    starts_s: list[float]  # where each sentence begins


class Voice:
    """Sentences spoken by the Piper starter through mlxd, each synthesized once per run."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.spoken: dict[str, np.ndarray] = {}

    def speak(self, text: str) -> np.ndarray:
        if text not in self.spoken:
            r = self.http.post("/v1/audio/speech", json={
                "model": VOICE_MODEL, "voice": "joe", "input": text, "response_format": "wav"})
            r.raise_for_status()
            self.spoken[text] = decode_16k(r.content)
        return self.spoken[text]

    def recording(self, seconds: float) -> Recording:
        """Whole sentences, each followed by its gap, while they fit in ``seconds``; the
        rest is silence. Shorter recordings are the start of longer ones."""
        target = int(seconds * RATE)
        gaps = random.Random(SEED + 1)
        pieces: list[np.ndarray] = []
        spoken: list[str] = []
        starts: list[float] = []
        length = 0
        for text in sentences():
            speech = self.speak(text)
            gap = np.zeros(int(round(gaps.uniform(*GAP_S), 2) * RATE), np.float32)
            if length + len(speech) > target:
                break
            starts.append(length / RATE)
            spoken.append(text)
            pieces += [speech, gap]
            length += len(speech) + len(gap)
        samples = np.concatenate(pieces)[:target]
        samples = np.concatenate([samples, np.zeros(target - len(samples), np.float32)])
        return Recording(seconds, samples, " ".join(spoken), starts)


# -- contenders ----------------------------------------------------------------------------

@dataclass
class Pass:
    wall_s: float
    cpu_s: float
    text: str


def mlxd_pass(http: httpx.Client, server_pid: int, audio: bytes, strategy: str) -> Pass:
    cpu = cpu_seconds(server_pid)
    started = time.perf_counter()
    r = http.post("/v1/audio/transcriptions",
                  data={"model": STT_MODEL, "chunking_strategy": strategy},
                  files={"file": ("speech.wav", audio, "audio/wav")})
    r.raise_for_status()
    wall = time.perf_counter() - started
    return Pass(wall, cpu_seconds(server_pid) - cpu, str(r.json()["text"]))


def raw_worker(folder: str, samples_path: str, out: str) -> int:
    """``--raw-worker``: mlx_whisper.transcribe on the samples, float32, as mlxd calls it;
    one warm-up on the first WARMUP_S seconds, then one timed pass."""
    import mlx_whisper

    samples = np.load(samples_path)

    def once(audio: np.ndarray) -> str:
        return str(mlx_whisper.transcribe(audio, path_or_hf_repo=folder, fp16=False,
                                          language="en")["text"]).strip()

    once(samples[:int(WARMUP_S * RATE)])
    cpu, started = time.process_time(), time.perf_counter()
    text = once(samples)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    Path(out).write_text(json.dumps({"wall_s": wall, "cpu_s": cpu, "text": text}))
    return 0


def raw_pass(folder: Path, samples_path: Path, env: dict[str, str]) -> Pass:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.json"
        subprocess.run([sys.executable, "-m", "bench.audio", "--raw-worker", str(folder),
                        str(samples_path), str(out)], env=env, check=True, cwd=REPO)
        return Pass(**json.loads(out.read_text()))


def converted_whisper(home: Path) -> Path:
    """The float32 mlx-whisper folder mlxd converted (the STT starter's first load made it)."""
    found = sorted((home / "models" / "converted").glob("whisper-*-float32"))
    if not found:
        raise SystemExit(f"no converted Whisper under {home}/models/converted")
    return found[0]


# -- the run -------------------------------------------------------------------------------

def compare(http: httpx.Client, server_pid: int, rec: Recording, repeats: int,
            env: dict[str, str], home: Path) -> dict[str, Any]:
    """Every contender ``repeats`` times on one recording, the order turning each repeat."""
    upload = wav_bytes(rec.samples)
    samples = decode_16k(upload)  # exactly what mlxd decodes from the upload
    seconds = rec.seconds
    passes: dict[str, list[Pass]] = {BATCHED: [], SEQUENTIAL: [], RAW: []}
    order = list(passes)
    with tempfile.TemporaryDirectory() as tmp:
        samples_path = Path(tmp) / "samples.npy"
        np.save(samples_path, samples)
        for repeat in range(repeats):
            for name in order[repeat % 3:] + order[:repeat % 3]:
                if name == RAW:
                    p = raw_pass(converted_whisper(home), samples_path, env)
                else:
                    p = mlxd_pass(http, server_pid, upload, STRATEGY[name])
                passes[name].append(p)
                print(f"bench.audio: {seconds:.0f} s, {name}: {p.wall_s:.1f} s", file=sys.stderr,
                      flush=True)
    raw_s = statistics.median(p.wall_s for p in passes[RAW])
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in passes.items():
        median = statistics.median(p.wall_s for p in runs)
        rows[name] = {"median_s": median, "x_realtime": seconds / median,
                      "vs_raw": raw_s / median,
                      "wer": statistics.median(word_error_rate(rec.reference, p.text)
                                               for p in runs),
                      "cpu_s": statistics.median(p.cpu_s for p in runs),
                      "runs_s": [p.wall_s for p in runs], "text": runs[-1].text}
    wer_points = 100 * (rows[BATCHED]["wer"] - rows[SEQUENTIAL]["wer"])
    target = TARGET_VS_RAW.get(seconds)
    return {"audio_seconds": seconds, "repeats": repeats, "sentences": len(rec.starts_s),
            "reference": rec.reference, "sentence_starts_s": rec.starts_s, "contenders": rows,
            "batched_vs_raw_target": target,
            "batched_vs_raw_met": None if target is None else rows[BATCHED]["vs_raw"] >= target,
            "wer_points_batched_minus_sequential": wer_points,
            "wer_met": wer_points <= TARGET_WER_POINTS}


def stt(args: argparse.Namespace, sizes: Sizes, env: dict[str, str]) -> list[dict[str, Any]]:
    with mlxd_audio_server("audio", [STARTER_STT, STARTER_TTS], home=args.home, out=args.out,
                           blas=args.blas, env=env) as (server, http):
        voice = Voice(http)
        recordings = [(voice.recording(seconds), repeats) for seconds, repeats in sizes.lengths]
        warmup = wav_bytes(recordings[0][0].samples[:int(WARMUP_S * RATE)])
        for strategy in STRATEGY.values():  # loads the model, first-call costs of each mode
            mlxd_pass(http, server.pid, warmup, strategy)
        return [compare(http, server.pid, rec, repeats, env, args.home)
                for rec, repeats in recordings]


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = ["# Speech to text: mlxd batched vs sequential vs raw mlx-whisper (Whisper tiny.en "
             "float32)", "", f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('blas')}",
             "", "Piper speech of generated sentences with 0.3-1.5 s pauses; median of the "
             "timed passes; WER against the text spoken; CPU s: the server (mlxd) or the "
             "worker process (raw) over one pass.", ""]
    for s in results["stt"]:
        lines += [f"## {s['audio_seconds']:.0f} s ({s['sentences']} sentences, "
                  f"{s['repeats']} repeat{'s' if s['repeats'] > 1 else ''})", "",
                  "| contender | median s | x realtime | vs raw | WER % | CPU s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, row in s["contenders"].items():
            lines.append(f"| {name} | {row['median_s']:.2f} | {row['x_realtime']:.2f} | "
                         f"{row['vs_raw']:.2f}x | {100 * row['wer']:.1f} | {row['cpu_s']:.1f} |")
        batched = s["contenders"][BATCHED]["vs_raw"]
        if s["batched_vs_raw_target"] is None:
            speed = f"batched / raw {batched:.2f}x (no target at this length)"
        else:
            speed = (f"batched / raw **{batched:.2f}x**, target {s['batched_vs_raw_target']}x: "
                     f"{'met' if s['batched_vs_raw_met'] else 'NOT met'}")
        lines += ["", f"- {speed}",
                  f"- WER batched - sequential: **{s['wer_points_batched_minus_sequential']:+.1f}"
                  f" points**, target at most +{TARGET_WER_POINTS:.0f}: "
                  f"{'met' if s['wer_met'] else 'NOT met'}", ""]
    lines += [f"vllm-mlx: {results['vllm-mlx']}", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.audio",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--raw-worker"]:
        return raw_worker(argv[1], argv[2], argv[3])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else FULL
    env, blas = subprocess_env(args.blas)
    results: dict[str, Any] = {"machine": {**machine(args.blas, ("mlx", "mlx-whisper")),
                                           "blas": blas}, "sizes": asdict(sizes)}
    results["stt"] = stt(args, sizes, env)
    results["vllm-mlx"] = ("not run: vllm-mlx 0.6.0's /v1/audio/transcriptions accepts only "
                           "its allowlist of Hugging Face ids (mlx-community/whisper-*, "
                           "parakeet), downloaded on first use, and refuses a local folder: "
                           "no offline Whisper")
    tag = "audio-quick" if args.quick else "audio"
    write_report(args.out, tag, results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
