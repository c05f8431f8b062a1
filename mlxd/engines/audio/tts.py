"""``TTSEngine``: text-to-speech, sentence by sentence, on the model's worker thread.

Two backends: Piper voices (VITS exported to ONNX, run by onnxruntime;
``tts_piper.py``) and mlx-audio's Kokoro (``tts_mlx_audio.py``). Both take
their phonemes from the espeak-ng program (``mlxd/media/phonemes.py``), so no
text front end here downloads anything. The engine splits the input into
sentences and synthesises one per worker job: the first sentence's audio is
sent while the rest is still to come, and two requests take turns.

The voice list is read from the model's files (``mlxd/models/voices.py``), so
the route refuses an unknown voice (400, listing the voices) before the model
is loaded; the engine checks again, as every caller is not a route.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxd.config import ServerConfig
from mlxd.engines.audio.speech_backend import SpeechBackend
from mlxd.engines.base import AudioChunk, SpeechRequest, Voice
from mlxd.errors import ModelLoadError
from mlxd.media.phonemes import split_sentences
from mlxd.models.engine import EngineFacts, EngineStats
from mlxd.models.voices import VoiceFile, check_speed, check_voice, piper_config_path
from mlxd.runtime.worker import ModelWorker

log = logging.getLogger(__name__)

# -- the engine ------------------------------------------------------------------

class TTSEngine:
    """A speech model behind the ``SpeechSynthesizer`` protocol."""

    kind = "tts"

    def __init__(self, name: str, path: Path, worker: ModelWorker, config: ServerConfig) -> None:
        self.name = name
        self.path = Path(path)
        self.worker = worker
        self.config = config
        self.backend: SpeechBackend | None = None
        self._voices: list[VoiceFile] = []
        self._requests = 0
        self._sentences = 0
        self._audio_seconds = 0.0
        self._synth_seconds = 0.0

    def load(self) -> None:
        """Pick the backend from the folder (Piper .onnx.json, else mlx-audio) and load it."""
        if piper_config_path(self.path) is not None:
            from mlxd.engines.audio.tts_piper import PiperBackend

            self.backend = PiperBackend.load(self.name, self.path)
        else:
            from mlxd.engines.audio.tts_mlx_audio import MlxAudioBackend

            self.backend = MlxAudioBackend.load(self.name, self.path)
        self._voices = list(self.backend.voices())
        if not self._voices:
            raise ModelLoadError(self.name, f"{self.path} offers no voices")
        log.info("tts model %s: %d voice(s), %d Hz", self.name, len(self._voices),
                 self.backend.sample_rate)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.backend = None

    def _loaded(self) -> SpeechBackend:
        if self.backend is None:
            raise ModelLoadError(self.name, "the model is not loaded")
        return self.backend

    def memory_bytes(self) -> int:
        return self.backend.memory_bytes() if self.backend else 0

    def describe(self) -> dict[str, Any]:
        backend = self._loaded()
        return {"sample_rate": backend.sample_rate, "voices": [v.id for v in self._voices],
                **backend.describe()}

    def facts(self) -> EngineFacts:
        return EngineFacts(sample_rate=self._loaded().sample_rate, voices=tuple(self.voices()),
                           card=self.describe())

    def stats(self) -> EngineStats:
        rtf = self._synth_seconds / self._audio_seconds if self._audio_seconds else 0.0
        return EngineStats(counters={
            "requests": self._requests, "sentences": self._sentences,
            "audio_seconds": round(self._audio_seconds, 3), "real_time_factor": round(rtf, 4)})

    def persist_state(self) -> int:
        return 0  # nothing outlives an unload

    def voices(self) -> list[Voice]:
        return [Voice(id=v.id, name=v.name, language=v.language) for v in self._voices]

    @property
    def sample_rate(self) -> int:
        return self._loaded().sample_rate

    async def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        """One chunk per sentence, each synthesised as its own worker job."""
        backend = self._loaded()
        check_voice(request.voice, [v.id for v in self._voices], self.name)
        check_speed(request.speed)
        self._requests += 1
        for sentence in split_sentences(request.text, backend.max_sentence_chars):
            started = time.perf_counter()
            samples = await self.worker.run(backend.speak, sentence, request.voice,
                                            request.speed)
            self._synth_seconds += time.perf_counter() - started
            self._sentences += 1
            self._audio_seconds += len(samples) / backend.sample_rate
            if len(samples):
                yield AudioChunk(pcm=np.asarray(samples, dtype="<i2").tobytes(),
                                 sample_rate=backend.sample_rate)


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import SpeechSynthesizer

    _implements: type[SpeechSynthesizer] = TTSEngine
