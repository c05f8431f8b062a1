"""The voices of a text-to-speech model folder, read from its files (no model load).

A Piper voice's ``<voice>.onnx.json`` names its speakers (or, single-speaker,
its dataset: the voice id); a Kokoro folder has one ``voices/<id>.safetensors``
per voice. The speech route reads them to refuse an unknown voice before
anything loads, and the engine checks the same lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.errors import InvalidRequest

SPEED_RANGE = (0.25, 4.0)  # OpenAI's


@dataclass(frozen=True)
class VoiceFile:
    id: str  # what a request's ``voice`` names
    name: str
    language: str | None = None


def piper_config_path(folder: Path) -> Path | None:
    """The folder's Piper ``<voice>.onnx.json`` (None: not a Piper voice)."""
    if folder.is_file() and folder.name.endswith(".onnx"):
        folder = Path(str(folder) + ".json")
        return folder if folder.is_file() else None
    configs = sorted(folder.glob("*.onnx.json")) if folder.is_dir() else []
    return configs[0] if configs else None


def piper_voices(config: dict[str, Any], config_path: Path) -> list[VoiceFile]:
    """A multi-speaker voice's speakers, or the one voice named after its dataset."""
    language = (config.get("language") or {}).get("code") or (config.get("espeak") or {}).get(
        "voice")
    speakers = config.get("speaker_id_map") or {}
    if speakers:
        return [VoiceFile(id=str(s), name=str(s), language=language) for s in speakers]
    name = str(config.get("dataset") or config_path.name.removesuffix(".onnx.json"))
    return [VoiceFile(id=name, name=name, language=language)]


# Kokoro voice files start with a language letter (af_heart: American English).
KOKORO_LANGUAGES = {"a": "en-us", "b": "en-gb", "e": "es", "f": "fr-fr", "h": "hi", "i": "it",
                    "j": "ja", "p": "pt-br", "z": "cmn"}


def kokoro_voices(folder: Path) -> list[VoiceFile]:
    """``voices/<id>.safetensors`` files, their language from the id's first letter."""
    files = sorted((folder / "voices").glob("*.safetensors"))
    return [VoiceFile(id=p.stem, name=p.stem, language=KOKORO_LANGUAGES.get(p.stem[:1]))
            for p in files]


def voices_in(folder: Path) -> list[VoiceFile]:
    """The voices a TTS model folder offers, read from its files (no model load)."""
    config_path = piper_config_path(folder)
    if config_path is not None:
        return piper_voices(json.loads(config_path.read_text(encoding="utf-8")), config_path)
    return kokoro_voices(folder)


def check_voice(voice: str, voices: list[str], model: str,
                aliases: dict[str, str] | None = None) -> None:
    """400 naming the voices (and the names that map onto them, ``aliases``) when
    ``voice`` is not one of them ([]: not known yet)."""
    if voices and voice not in voices:
        names = ", ".join(voices)
        also = f"; other names it takes: {', '.join(aliases)}" if aliases else ""
        raise InvalidRequest(f"Model '{model}' has no voice '{voice}'; its voices: {names}"
                             f"{also} (GET /v1/audio/voices?model=... lists them).",
                             param="voice", code="unknown_voice")


def resolve_voice(voice: str, aliases: dict[str, str]) -> str:
    """The model's own voice for ``voice``: itself, or what a registry alias maps it to
    (``voice_aliases: {alloy: joe}``). A model's own voice wins over an alias of that name."""
    return aliases.get(voice, voice)


def check_speed(speed: float) -> None:
    """400 unless ``speed`` is in OpenAI's range (NaN included: it is in no range)."""
    low, high = SPEED_RANGE
    if not low <= speed <= high:
        raise InvalidRequest(f"speed is {speed}; it must be between {low} and {high}.",
                             param="speed")
