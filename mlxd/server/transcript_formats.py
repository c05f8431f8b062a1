"""A ``Transcription`` in OpenAI's response formats: json, text, srt, vtt, verbose_json
(``stream=true`` is ``transcript_stream.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mlxd.engines.base import Transcription, TranscriptSegment


def usage(t: Transcription) -> dict[str, Any]:
    """OpenAI's duration usage of a transcription."""
    # OpenAI bills whisper-1 by the second, rounded up.
    return {"type": "duration", "seconds": math.ceil(t.duration)}


def timestamp(seconds: float, decimal: str) -> str:
    """``HH:MM:SS,mmm`` (srt, ``decimal=","``) or ``HH:MM:SS.mmm`` (vtt)."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _cues(t: Transcription) -> list[TranscriptSegment]:
    return [s for s in t.segments if s.text.strip()]


def to_srt(t: Transcription) -> str:
    """SubRip: numbered cues, ``start --> end``, the text, a blank line."""
    return "".join(f"{i}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n"
                   f"{s.text.strip()}\n\n" for i, s in enumerate(_cues(t), start=1))


def to_vtt(t: Transcription) -> str:
    """WebVTT: the ``WEBVTT`` header, then ``start --> end`` cues."""
    return "WEBVTT\n\n" + "".join(f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n"
                                  f"{s.text.strip()}\n\n" for s in _cues(t))


def verbose_json(t: Transcription, task: str,
                 granularities: Sequence[str]) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: segments (unless only words were asked for), words when
    asked for, with times in seconds from the start of the recording."""
    body: dict[str, Any] = {"task": task, "language": t.language_name or t.language or "", "duration": t.duration,
                            "text": t.text}
    if list(granularities) != ["word"]:
        body["segments"] = [
            {"id": s.id, "seek": 0, "start": s.start, "end": s.end, "text": s.text,
             "tokens": list(s.tokens), "temperature": 0.0,
             "avg_logprob": s.avg_logprob if s.avg_logprob is not None else 0.0,
             "compression_ratio": s.compression_ratio if s.compression_ratio is not None
             else 0.0,
             "no_speech_prob": s.no_speech_prob if s.no_speech_prob is not None else 0.0}
            for s in t.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in t.words]
    body["usage"] = usage(t)
    return body


def render(t: Transcription, response_format: str, task: str,
           granularities: Sequence[str]) -> Response:
    """The HTTP response for ``response_format``."""
    if response_format == "text":
        return PlainTextResponse(t.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(to_srt(t), media_type="application/x-subrip")
    if response_format == "vtt":
        return PlainTextResponse(to_vtt(t), media_type="text/vtt")
    if response_format == "verbose_json":
        return JSONResponse(verbose_json(t, task, granularities))
    return JSONResponse({"text": t.text, "usage": usage(t)})
