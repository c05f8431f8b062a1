"""mlx-audio's Kokoro: the model through mlx-audio's loader, the text front end our own.

mlx-audio's ``KokoroPipeline`` phonemizes English with misaki, whose G2P
loads a spaCy model and downloads it when it is missing (a network call in
the middle of a request). mlxd never builds that pipeline: phonemes come from
the espeak-ng program (``mlxd/media/phonemes.py``, never the network), mapped
onto Kokoro's symbol set as misaki's own espeak fallback does (affricates and
diphthongs as single symbols), and the model is called directly with the
voice pack's style row for that many phonemes, as the pipeline does.

Voices are ``voices/<id>.safetensors`` in the model folder; an id's first
letter is its language (``a`` American English, ``b`` British, ...). Other
mlx-audio TTS families are refused at load with a clear error (not served yet).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engines.audio.speech_backend import to_int16
from mlxd.engines.device import device_name
from mlxd.engines.upstream import mlx_audio as audio_internals
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.media.phonemes import Espeak, EspeakFailed, EspeakMissing, find_espeak
from mlxd.models.voices import KOKORO_LANGUAGES, VoiceFile, kokoro_voices

log = logging.getLogger(__name__)

SUPPORTED = {"kokoro"}
MAX_PHONEMES = 510  # Kokoro's context is 512 ids with the two boundary tokens
# espeak-ng IPA -> Kokoro's symbols (misaki's espeak fallback does the same merges).
_COMMON = (("dʒ", "ʤ"), ("tʃ", "ʧ"), ("ɚ", "əɹ"), ("ɝ", "ɜɹ"))
_ENGLISH = (("eɪ", "A"), ("aɪ", "I"), ("aʊ", "W"), ("ɔɪ", "Y"), ("r", "ɹ"), ("ɐ", "ə"),
            ("x", "k"), ("ɬ", "l"))
_AMERICAN = (("oʊ", "O"), ("ː", ""))
_BRITISH = (("əʊ", "Q"),)


def kokoro_phonemes(ipa: str, language: str) -> str:
    """espeak-ng's IPA in Kokoro's symbol set for ``language`` (an espeak voice)."""
    pairs: tuple[tuple[str, str], ...] = _COMMON
    if language.startswith("en"):
        pairs += _ENGLISH + (_AMERICAN if language == "en-us" else _BRITISH)
    for old, new in pairs:
        ipa = ipa.replace(old, new)
    return ipa


class MlxAudioBackend:
    """A Kokoro model loaded by mlx-audio, with its voice packs."""

    max_sentence_chars = 200  # English averages ~1.2 phonemes per character

    def __init__(self, name: str, model: Any, folder: Path, voices: list[VoiceFile],
                 espeak: str, patch: Any) -> None:
        self.name = name
        self.model = model
        self.folder = folder
        self._voices = voices
        self._espeak = espeak
        self._patch = patch  # the CPU convolution patch's handle (None on a GPU)
        self.sample_rate = int(getattr(model, "sample_rate", 24_000))
        self.vocab: dict[str, int] = dict(model.config.vocab)
        self._packs: dict[str, mx.array] = {}
        self._weights = sum(int(v.nbytes) for _, v in _flat(model.parameters()))

    @classmethod
    def load(cls, name: str, path: Path) -> MlxAudioBackend:
        """Check the family, the voices and espeak-ng first; then mlx-audio loads it."""
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model_type = str(config.get("model_type") or "")
        if model_type not in SUPPORTED:
            raise ModelLoadError(name, f"mlxd serves the mlx-audio TTS families "
                                       f"{sorted(SUPPORTED)} and Piper voices; this model's "
                                       f"model_type is {model_type or 'missing'!r}")
        voices = kokoro_voices(path)
        if not voices:
            raise ModelLoadError(name, f"{path} has no voices/<id>.safetensors voice packs")
        try:
            program = find_espeak()
        except EspeakMissing as e:
            raise ModelLoadError(name, str(e)) from e
        from mlx_audio.tts.utils import load_model

        audio_internals.ADAPTER.require(name)
        try:
            model = load_model(path)
        except Exception as e:
            raise ModelLoadError(name, f"mlx-audio cannot load {path}: "
                                       f"{type(e).__name__}: {e}") from e
        patch = None
        if device_name() == "cpu":
            from mlxd.engines.audio.patches import registry

            patch = registry().activate(model_type, name, (model, None))
        return cls(name, model, path, voices, program, patch)

    def voices(self) -> list[VoiceFile]:
        return list(self._voices)

    def _pack(self, voice: str) -> mx.array:
        if voice not in self._packs:
            pack: Any = mx.load(str(self.folder / "voices" / f"{voice}.safetensors"))
            self._packs[voice] = pack["voice"] if isinstance(pack, dict) else pack
        return self._packs[voice]

    def phonemes(self, text: str, voice: str) -> str:
        """Kokoro phonemes for one sentence, cut to the model's context."""
        language = KOKORO_LANGUAGES.get(voice[:1], "en-us")
        try:
            ipa = Espeak(self._espeak, language).phonemize(text)
        except EspeakFailed as e:
            raise InvalidRequest(f"cannot phonemize the input: {e}", param="input") from e
        known = "".join(ch for ch in kokoro_phonemes(ipa, language) if ch in self.vocab)
        return known[:MAX_PHONEMES]

    def speak(self, text: str, voice: str, speed: float) -> np.ndarray:
        """One sentence through the model with the voice's style row for its length."""
        phonemes = self.phonemes(text, voice)
        if not phonemes.strip():
            return np.zeros(0, dtype=np.int16)
        pack = self._pack(voice)
        # The pack has one style row per phoneme count; MLX does not bounds-check indices.
        row = min(len(phonemes), int(pack.shape[0])) - 1
        audio = self.model(phonemes, pack[row], speed)
        mx.eval(audio)
        return to_int16(np.array(audio))

    def memory_bytes(self) -> int:
        return self._weights + sum(int(p.nbytes) for p in self._packs.values())

    def describe(self) -> dict[str, Any]:
        return {"backend": "mlx-audio", "family": "kokoro", "phonemizer": "espeak-ng",
                "cpu_conv_patch": self._patch is not None}

    def close(self) -> None:
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
        self.model = None
        self._packs.clear()


def _flat(params: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    flat: list[tuple[str, Any]] = tree_flatten(params)  # type: ignore[assignment]
    return [(k, v) for k, v in flat if isinstance(v, mx.array)]
