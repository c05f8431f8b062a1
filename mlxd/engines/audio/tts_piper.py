"""Piper voices: a VITS model exported to ONNX, run by onnxruntime on the CPU.

A Piper voice folder holds ``<voice>.onnx`` and ``<voice>.onnx.json`` (sample
rate, espeak-ng voice, phoneme-id map, inference scales, speakers). Phonemes
come from the espeak-ng program (``mlxd/media/phonemes.py``); the ids follow
Piper's layout: ``^``, then each phoneme followed by the pad ``_``, then ``$``.
Speed divides the length scale (speed 2 halves every phoneme's duration).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.engines.audio.speech_backend import to_int16
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.media.phonemes import Espeak, EspeakFailed, EspeakMissing, check_voice, find_espeak
from mlxd.models.voices import VoiceFile, piper_config_path, piper_voices

BOS, EOS, PAD = "^", "$", "_"


class PiperBackend:
    """One Piper voice (possibly multi-speaker)."""

    max_sentence_chars = 400

    def __init__(self, session: Any, config: dict[str, Any], espeak: Espeak,
                 voices: list[VoiceFile], weights_bytes: int) -> None:
        self.session = session
        self.config = config
        self.espeak = espeak
        self._voices = voices
        self._weights_bytes = weights_bytes
        self.sample_rate = int((config.get("audio") or {}).get("sample_rate") or 22050)
        self.id_map: dict[str, list[int]] = config.get("phoneme_id_map") or {}
        self.speakers: dict[str, int] = config.get("speaker_id_map") or {}
        inference = config.get("inference") or {}
        self.noise_scale = float(inference.get("noise_scale", 0.667))
        self.length_scale = float(inference.get("length_scale", 1.0))
        self.noise_w = float(inference.get("noise_w", 0.8))
        self._inputs = {i.name for i in session.get_inputs()}

    @classmethod
    def load(cls, name: str, path: Path) -> PiperBackend:
        """Read the .onnx.json, check espeak-ng knows its voice, open the ONNX session."""
        config_path = piper_config_path(path)
        if config_path is None:
            raise ModelLoadError(name, f"{path} has no Piper <voice>.onnx.json")
        onnx_path = Path(str(config_path).removesuffix(".json"))
        if not onnx_path.is_file():
            raise ModelLoadError(name, f"{config_path.name} has no {onnx_path.name} beside it")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("phoneme_type", "espeak") != "espeak" or not config.get("phoneme_id_map"):
            raise ModelLoadError(name, "mlxd speaks Piper voices with espeak phonemes; this "
                                       f"one has phoneme_type={config.get('phoneme_type')!r}")
        try:
            espeak = Espeak(find_espeak(), (config.get("espeak") or {}).get("voice") or "en-us")
            check_voice(espeak)
        except (EspeakMissing, EspeakFailed) as e:
            raise ModelLoadError(name, str(e)) from e
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # its warnings about unused initialisers are noise
        try:
            session = onnxruntime.InferenceSession(str(onnx_path), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ModelLoadError(name, f"onnxruntime cannot open {onnx_path.name}: "
                                       f"{type(e).__name__}: {e}") from e
        return cls(session, config, espeak, piper_voices(config, config_path),
                   onnx_path.stat().st_size)

    def voices(self) -> list[VoiceFile]:
        return list(self._voices)

    def phoneme_ids(self, phonemes: str) -> list[int]:
        """Piper's id layout; phonemes the voice does not know are skipped."""
        ids = list(self.id_map[BOS]) + list(self.id_map[PAD])
        for ch in unicodedata.normalize("NFD", phonemes):
            if ch in self.id_map:
                ids.extend(self.id_map[ch])
                ids.extend(self.id_map[PAD])
        ids.extend(self.id_map[EOS])
        return ids

    def speak(self, text: str, voice: str, speed: float) -> np.ndarray:
        """One sentence: espeak-ng phonemes, then one ONNX run."""
        try:
            phonemes = self.espeak.phonemize(text)
        except EspeakFailed as e:
            raise InvalidRequest(f"cannot phonemize the input: {e}", param="input") from e
        if not phonemes:
            return np.zeros(0, dtype=np.int16)
        ids = self.phoneme_ids(phonemes)
        feeds: dict[str, np.ndarray] = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([self.noise_scale, self.length_scale / speed, self.noise_w],
                               dtype=np.float32),
        }
        if "sid" in self._inputs:
            feeds["sid"] = np.array([self.speakers.get(voice, 0)], dtype=np.int64)
        audio = self.session.run(None, feeds)[0]
        return to_int16(audio)

    def memory_bytes(self) -> int:
        # onnxruntime holds the fp32 initialisers once, plus its arena.
        return self._weights_bytes

    def describe(self) -> dict[str, Any]:
        return {"backend": "piper (onnxruntime)", "phonemizer": "espeak-ng",
                "espeak_voice": self.espeak.voice}

    def close(self) -> None:
        self.session = None
