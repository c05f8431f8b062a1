"""What ``TTSEngine`` needs of a speech backend (Piper in ``tts_piper.py``, mlx-audio's
Kokoro in ``tts_mlx_audio.py``), and the sample format they share. The backends import
this module, never the engine, so the engine may pick them lazily without a cycle."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from mlxd.models.voices import VoiceFile


class SpeechBackend(Protocol):
    """One loaded TTS model; every method but ``voices`` runs on the worker thread."""

    sample_rate: int
    max_sentence_chars: int  # longer sentences are cut before they reach the model

    def voices(self) -> list[VoiceFile]: ...

    def speak(self, text: str, voice: str, speed: float) -> np.ndarray:
        """Mono int16 samples for one sentence."""

    def memory_bytes(self) -> int: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def to_int16(audio: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] (clipped) as int16."""
    flat = np.asarray(audio, dtype=np.float32).reshape(-1)
    return (np.clip(np.nan_to_num(flat), -1.0, 1.0) * 32767.0).astype(np.int16)
