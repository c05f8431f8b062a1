"""``STTEngine``: speech to text on the model's worker thread.

Whisper folders (mlx-whisper's layout: ModelDimensions in ``config.json``) run
through mlx-whisper's window-by-window loop (``stt_whisper.py``); the
CTranslate2 starter is converted to that layout when its source is resolved.
A recording longer than one window is cut at its pauses and its windows decoded
as one batch (``stt_batched.py``) unless the request's ``chunking_strategy`` asks
for the sequential loop; concurrent uploads share those batches
(``stt_window_batcher.py``, the worker's stepper, as the text scheduler is). Other folders whose ``model_type`` is one of mlx-audio's speech-recognition
families load through mlx-audio's loader (``stt_mlx_audio.py``).
Weights are float32 on a CPU (MLX's float16 CPU kernels are ~8x slower) and
float16 on a GPU. A sequential request runs as one job on the model's ``ModelWorker``
(jobs queue there in arrival order, between batches), never on the event loop.
A job whose caller gives up (client gone, unload) stops at its next 30 s window; a
batched upload's windows stop being decoded, and a batch nobody waits for any more
stops at its next token.
A recording that is digital silence gets an empty transcript without a decode
(Whisper tends to hallucinate words into silence).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxd.config import ServerConfig
from mlxd.engines.audio.stt_batched import Upload, use_batched
from mlxd.engines.audio.stt_mlx_audio import (
    check_request,
    load_mlx_audio,
    mlx_audio_model_type,
    run_mlx_audio,
)
from mlxd.engines.audio.stt_whisper import (
    bind_transcribe,
    check_language,
    is_whisper_folder,
    language_name,
    load_whisper,
    run_whisper,
    segment_text,
    temperatures,
)
from mlxd.engines.audio.stt_window_batcher import WindowBatcher
from mlxd.engines.base import (
    Transcription,
    TranscriptionRequest,
    TranscriptSegment,
    TranscriptWord,
)
from mlxd.engines.device import device_name, weights_nbytes
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.models.engine import EngineFacts, EngineStats
from mlxd.runtime.worker import CancelToken, ModelWorker

log = logging.getLogger(__name__)

SILENCE_PEAK = 1e-4  # about -80 dBFS: nothing a recogniser could hear


class STTEngine:
    """A speech recogniser served one recording at a time on its worker thread."""

    kind = "stt"

    def __init__(self, name: str, path: Path, worker: ModelWorker, config: ServerConfig) -> None:
        self.name = name
        self.path = Path(path)
        self.worker = worker
        self.model: Any = None
        self._transcribe: Any = None
        self._batcher: WindowBatcher | None = None  # Whisper folders
        self._weights = 0
        self.backend = "unloaded"
        # The running job's text sink (jobs run one at a time on the worker thread).
        self._on_text: Callable[[str], None] | None = None
        self._cancel: CancelToken | None = None  # the running job's
        self._lock = threading.Lock()  # counters: read on the event loop, written on the worker
        self._counts = {"requests": 0, "running": 0, "audio_seconds": 0.0, "busy_seconds": 0.0}

    # -- lifecycle (worker thread) -------------------------------------------------------
    def load(self) -> None:
        """Load the weights (float32 on CPU); raises ``ModelLoadError`` with the reason."""
        dtype = mx.float32 if device_name() == "cpu" else mx.float16
        family = None if is_whisper_folder(self.path) else mlx_audio_model_type(self.path)
        if family is None and not is_whisper_folder(self.path):
            raise ModelLoadError(self.name, f"{self.path} is neither a Whisper folder "
                                            "(config.json with n_mels / n_audio_ctx and "
                                            "weights.safetensors) nor an mlx-audio speech "
                                            "recognition family (config.json model_type)")
        try:
            if family is None:
                self.model = load_whisper(self.name, self.path, dtype)
                self._transcribe = bind_transcribe(self.name, self.model, self._printed,
                                                   self._check_cancelled)
                self._batcher = WindowBatcher(self.model, self.worker.wake)
                self.worker.set_stepper(self._batcher)
            else:
                self.model = load_mlx_audio(self.name, self.path)
                self.model.set_dtype(dtype)
                mx.eval(self.model.parameters())
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
        self.backend = "mlx-whisper" if family is None else f"mlx-audio ({family})"
        self._weights = weights_nbytes(self.model)
        log.info("stt model %s: %s, %s", self.name, self.backend, dtype)

    def close(self) -> None:
        """Fail the uploads waiting for a batch, drop the weights. Safe to call twice."""
        if self._batcher is not None:
            self._batcher.close()
            self.worker.set_stepper(None)
        self._batcher = None
        self.model = None
        self._transcribe = None
        gc.collect()
        mx.clear_cache()

    # -- facts ---------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        return self._weights

    def describe(self) -> dict[str, Any]:
        whisper = self.model is not None and self._transcribe is not None
        return {"backend": self.backend, "sample_rate": 16_000, "window_seconds": 30,
                "multilingual": bool(self.model.is_multilingual) if whisper else None,
                "n_mels": self.model.dims.n_mels if whisper else None}

    def facts(self) -> EngineFacts:
        return EngineFacts(sample_rate=16_000, card=self.describe())

    def stats(self) -> EngineStats:
        """Requests and audio seconds; with a Whisper model, its shared batches
        (``shared_batches``: batches that held windows of more than one upload)."""
        with self._lock:
            counts = dict(self._counts)
        if self._batcher is not None:
            batches = self._batcher.stats()
            counts["busy_seconds"] += batches.pop("batch_seconds")
            counts.update(batches)
        return EngineStats(running=int(counts["running"]), counters=counts)

    def persist_state(self) -> int:
        return 0  # nothing outlives an unload

    # -- requests ------------------------------------------------------------------------
    async def transcribe(self, request: TranscriptionRequest,
                         on_text: Callable[[str], None] | None = None) -> Transcription:
        """The whole transcript of ``request``, computed on the model's worker thread;
        ``on_text`` gets each segment's (or window's) text as soon as it is decoded."""
        if request.sample_rate != 16_000:
            raise InvalidRequest(f"Model '{self.name}' reads 16 kHz audio, not "
                                 f"{request.sample_rate} Hz.", param="file")
        duration = len(request.audio) / request.sample_rate
        audio = request.audio  # the peak from max and min: abs() would copy the recording
        if not audio.size or max(float(audio.max()), -float(audio.min())) < SILENCE_PEAK:
            language = request.language or ("en" if request.task == "translate" else None)
            return Transcription(text="", language=language, duration=duration,
                                 language_name=language_name(language))
        with self._lock:
            self._counts["requests"] += 1
            self._counts["running"] += 1
        try:
            batcher = self._batcher
            if batcher is None or not use_batched(request):
                return await self.worker.run_cancellable(self._run, request, duration, on_text)
            result = await self.worker.wait_cancellable(
                lambda token: batcher.submit(Upload(
                    request, lambda: check_language(self.name, self.model, request),
                    temperatures(request), on_text, token)))
            with self._lock:
                self._counts["audio_seconds"] += duration
            return to_transcription(result, duration)
        finally:
            with self._lock:
                self._counts["running"] -= 1

    def _printed(self, line: str) -> None:
        text = segment_text(line)
        if text is not None and self._on_text is not None:
            self._on_text(text)

    def _check_cancelled(self) -> None:
        if self._cancel is not None:
            self._cancel.check()

    def _run(self, request: TranscriptionRequest, duration: float,
             on_text: Callable[[str], None] | None, cancel: CancelToken) -> Transcription:
        if self.model is None:
            raise InvalidRequest(f"Model '{self.name}' is not loaded.")
        cancel.check()  # gave up while queued
        t0 = time.monotonic()
        self._on_text, self._cancel = on_text, cancel
        try:
            if self._transcribe is not None:
                language = check_language(self.name, self.model, request)
                result = run_whisper(self._transcribe, self.model, request, language,
                                     verbose=on_text is not None)
            else:
                check_request(self.name, request)
                result = run_mlx_audio(self.model, request, on_text, cancel.check)
        finally:
            self._on_text = self._cancel = None
            # The freed buffers of the job's peak go back to the system instead of
            # staying in MLX's cache between requests, where the memory budget does not
            # see them.
            mx.clear_cache()
        with self._lock:
            self._counts["audio_seconds"] += duration
            self._counts["busy_seconds"] += time.monotonic() - t0
        return to_transcription(result, duration)


def to_transcription(result: dict[str, Any], duration: float) -> Transcription:
    """mlx-whisper's result dict as our value types (times clamped to the recording)."""
    segments: list[TranscriptSegment] = []
    words: list[TranscriptWord] = []
    for seg in result.get("segments", []):
        start, end = min(float(seg["start"]), duration), min(float(seg["end"]), duration)
        segments.append(TranscriptSegment(
            id=len(segments), start=start, end=max(start, end), text=str(seg["text"]),
            tokens=tuple(int(t) for t in seg.get("tokens", [])),
            avg_logprob=_float(seg.get("avg_logprob")),
            no_speech_prob=_float(seg.get("no_speech_prob")),
            compression_ratio=_float(seg.get("compression_ratio"))))
        for w in seg.get("words", []) or []:
            w_start = min(float(w["start"]), duration)
            words.append(TranscriptWord(str(w["word"]).strip(), w_start,
                                        max(w_start, min(float(w["end"]), duration))))
    language = result.get("language")
    return Transcription(text=str(result.get("text", "")).strip(),
                         language=language, duration=duration,
                         segments=tuple(segments), words=tuple(words),
                         language_name=language_name(language))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import Transcriber

    _implements: type[Transcriber] = STTEngine
