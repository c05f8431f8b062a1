"""``TTSEngine``: text-to-speech, sentence by sentence, on the model's worker thread.

Two backends: Piper voices (VITS exported to ONNX, run by onnxruntime;
``tts_piper.py``) and mlx-audio's Kokoro (``tts_mlx_audio.py``). Both take
their phonemes from the espeak-ng program (``mlxd/media/phonemes.py``), so no
text front end here downloads anything. The engine splits the input into
sentences and synthesises one per worker job: the first sentence's audio is
sent while the rest is still to come, and concurrent requests take turns sentence
by sentence (each has one sentence queued at a time, so a new request's first
sentence waits behind at most one sentence of each other request: its time to
first audio stays one sentence's synthesis, not another request's whole text).

Sentences are not batched through the model. Piper's ONNX graph takes a batch
(``input`` is ``[batch_size, phonemes]``, ``input_lengths`` ``[batch_size]``), but
its output is padded to the longest row and does not say where each row's audio
ends: the padded tail of a shorter row is not silent (up to 0.033 full scale at zero
noise) and its length depends on the durations the model draws at random, so it
cannot be cut off exactly. Nor is it faster on a CPU: 8 sentences took 1.15 s as one
batch against 0.93 s one by one (onnxruntime already uses every core for one row,
and padding adds work). Measured with the starter voice, onnxruntime 1.32, 2 cores.

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
        self._in_flight = 0
        self._most_in_flight = 0  # concurrent requests sharing the worker, at most
        self._turns = 0  # sentences that followed another request's sentence
        self._last: object = None  # the request whose sentence ran last

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
        return EngineStats(running=self._in_flight, counters={
            "requests": self._requests, "sentences": self._sentences,
            "audio_seconds": round(self._audio_seconds, 3), "real_time_factor": round(rtf, 4),
            "most_concurrent": self._most_in_flight, "turns_between_requests": self._turns})

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
        self._in_flight += 1
        self._most_in_flight = max(self._most_in_flight, self._in_flight)
        me = object()
        try:
            for sentence in split_sentences(request.text, backend.max_sentence_chars):
                started = time.perf_counter()
                samples = await self.worker.run(backend.speak, sentence, request.voice,
                                                request.speed)
                # Jobs run in submission order, so completions arrive in running order.
                self._turns += self._last is not None and self._last is not me
                self._last = me
                self._synth_seconds += time.perf_counter() - started
                self._sentences += 1
                self._audio_seconds += len(samples) / backend.sample_rate
                if len(samples):
                    yield AudioChunk(pcm=np.asarray(samples, dtype="<i2").tobytes(),
                                     sample_rate=backend.sample_rate)
        finally:
            self._in_flight -= 1


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import SpeechSynthesizer

    _implements: type[SpeechSynthesizer] = TTSEngine
