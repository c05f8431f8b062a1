"""mlx-audio's speech-recognition families (moonshine, parakeet, voxtral...) through its loader.

``mlx_audio.stt.utils.load_model(folder)`` picks the family from ``config.json``'s
``model_type``; every family's ``generate(audio)`` returns an ``STTOutput`` (text, maybe
segments). Families differ in how much audio one call takes, so long recordings are cut
here into 30 s windows, each transcribed on its own, with segment times offset to the
recording. Word timestamps and translation are Whisper's: a request for them is a 400.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.engines.base import TranscriptionRequest
from mlxd.errors import InvalidRequest, ModelLoadError

WINDOW_SECONDS = 30


def mlx_audio_model_type(path: Path) -> str | None:
    """The folder's ``model_type`` when mlx-audio ships an STT family of that name."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = str(config.get("model_type") or "") if isinstance(config, dict) else ""
    if not model_type.isidentifier():
        return None
    try:
        found = importlib.util.find_spec(f"mlx_audio.stt.models.{model_type}")
    except (ImportError, ValueError):
        return None
    return model_type if found is not None else None


def load_mlx_audio(name: str, path: Path) -> Any:
    """The family's model, loaded by mlx-audio from the local folder."""
    try:
        from mlx_audio.stt.utils import load_model
    except ImportError as e:
        raise ModelLoadError(name, "mlx-audio speech models need the 'audio' extra: "
                                   "pip install 'mlxd[audio]'") from e
    return load_model(path)  # a Path: never taken for a hub id


def check_request(name: str, request: TranscriptionRequest) -> None:
    """400 for what only Whisper gives (word timings, translation)."""
    if request.word_timestamps:
        raise InvalidRequest(f"Model '{name}' gives no word timestamps; ask for "
                             "timestamp_granularities ['segment'] or use a Whisper model.",
                             param="timestamp_granularities")
    if request.task == "translate":
        raise InvalidRequest(f"Model '{name}' cannot translate; use a multilingual Whisper "
                             "model.", param="model")


def run_mlx_audio(model: Any, request: TranscriptionRequest,
                  on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Window by window: one ``generate`` per 30 s, segments offset to the recording;
    ``on_text`` gets each window's text as soon as it is decoded."""
    rate = request.sample_rate
    step = WINDOW_SECONDS * rate
    options: dict[str, Any] = {"temperature": request.temperature}
    if request.language is not None:
        options["language"] = request.language
    texts: list[str] = []
    segments: list[dict[str, Any]] = []
    for start in range(0, len(request.audio), step):
        window = request.audio[start:start + step]
        out = model.generate(window, **options)
        text = str(out.text).strip()
        offset, length = start / rate, len(window) / rate
        for seg in _segments(out, text, length):
            segments.append({**seg, "start": offset + seg["start"], "end": offset + seg["end"]})
        if text:
            texts.append(text)
            if on_text is not None:
                on_text(" " + text)
    return {"text": " ".join(texts), "segments": segments,
            "language": request.language or getattr(model, "language", None)}


def _segments(out: Any, text: str, length: float) -> list[dict[str, Any]]:
    """The family's own timed segments, or the window as one segment."""
    timed = [s for s in (out.segments or []) if isinstance(s, dict) and str(s.get("text", ""))
             .strip() and float(s.get("end") or 0) > float(s.get("start") or 0)]
    if timed:
        return [{"text": " " + str(s["text"]).strip(), "start": float(s["start"]),
                 "end": min(float(s["end"]), length)} for s in timed]
    return [{"text": " " + text, "start": 0.0, "end": length}] if text else []
