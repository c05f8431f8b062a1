"""Batched long-form Whisper: cut at pauses, decode the windows as one batch.

mlx-whisper's ``transcribe`` decodes a long recording one 30-s window after
another, each conditioned on the text of the one before, so a 3-min file is six
sequential encoder passes and six token loops of batch 1. Here the recording is
cut where the speech pauses (an energy voice-activity detector: no model, no
extra package) into windows of at most 30 s, and the windows run through the
encoder and the token loop together (``mlx_whisper.decoding.decode`` takes a
batch of mel spectrograms), without the previous window's text as a prompt, as
faster-whisper's batched pipeline and WhisperX do. Each window's timestamp tokens
become segments at absolute times (window start + token position x 20 ms); word
timings come from mlx-whisper's cross-attention alignment, window by window.

Temperature fallback is OpenAI's: a window whose text looks like a failure
(too repetitive, too improbable) is decoded again at the next temperature, the
failing windows of a batch together. A window Whisper scores as no speech (and
improbable) yields no segment, as in the sequential loop.

Everything here is mlx-whisper's public API (``decode``, ``DecodingOptions``,
``log_mel_spectrogram``, ``add_word_timestamps``, the model's ``detect_language``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engines.base import Chunking, TranscriptionRequest
from mlxd.models.memory import SPEECH_BATCH_WINDOWS
from mlxd.runtime.channel import Reply
from mlxd.runtime.worker import CancelToken

RATE = 16_000
WINDOW_SECONDS = 30.0
FRAME = 320  # 20 ms: the VAD's frame, a multiple of Whisper's 160-sample hop
# OpenAI's thresholds for the fallback and the no-speech skip (mlx_whisper.transcribe's).
COMPRESSION_RATIO_MAX = 2.4
LOGPROB_MIN = -1.0
NO_SPEECH_MIN = 0.6
# A window may not end more than this long before the last speech its detector heard.
SPEECH_LEFT_S = 1.0
# Windows through the encoder and the token loop at once, from one upload or several
# (the attention scores of large-v3's encoder are ~90 MB per window in float16, per
# layer, while it runs): the model's memory estimate reserves this many.
BATCH_SIZE = SPEECH_BATCH_WINDOWS


def speech_frames(audio: np.ndarray, vad: Chunking) -> np.ndarray:
    """Which 20-ms frames are speech (see ``speech_spans``): a frame is speech when its RMS
    reaches ``threshold`` x 10% of the recording's loud level (its 95th-percentile frame)."""
    n = len(audio) // FRAME
    if n == 0:
        return np.zeros(0, dtype=bool)
    frames = audio[: n * FRAME].astype(np.float32).reshape(n, FRAME)
    rms = np.sqrt(np.mean(frames * frames, axis=1))
    loud = float(np.percentile(rms, 95))
    return np.asarray(rms >= max(loud * 0.1 * vad.threshold, 1e-4))


def speech_spans(audio: np.ndarray, vad: Chunking) -> list[tuple[int, int]]:
    """Stretches of speech as (start, end) sample offsets, padded, frame aligned.

    OpenAI's ``server_vad`` knobs, read for an energy detector: a 20-ms frame is speech
    when its RMS reaches ``threshold`` x 10% of the recording's loud level (its
    95th-percentile frame), so 0.5 is 26 dB below it; a pause shorter than
    ``silence_duration_ms`` does not end the speech; ``prefix_padding_ms`` of audio is
    kept around each stretch.
    """
    n = len(audio) // FRAME
    if n == 0:
        return [(0, len(audio))] if len(audio) else []
    speech = speech_frames(audio, vad)
    min_gap = max(1, round(vad.silence_duration_ms / 20))
    pad = round(vad.prefix_padding_ms / 20)
    spans: list[list[int]] = []
    for i in np.flatnonzero(speech):
        if spans and i - spans[-1][1] < min_gap:
            spans[-1][1] = int(i) + 1
        else:
            spans.append([int(i), int(i) + 1])
    out: list[tuple[int, int]] = []
    prev_end = 0
    for k, (s, e) in enumerate(spans):
        lo = max(s - pad, prev_end)
        hi = min(e + pad, spans[k + 1][0] if k + 1 < len(spans) else n)
        out.append((lo * FRAME, len(audio) if hi == n else hi * FRAME))
        prev_end = hi
    return out


def speech_ends(audio: np.ndarray, vad: Chunking, cuts: list[tuple[int, int]]) -> list[float]:
    """Where the last speech frame of each window ends, in seconds from the window's start
    (0.0 for a window without one)."""
    speech = speech_frames(audio, vad)
    out = []
    for s, e in cuts:
        found = np.flatnonzero(speech[s // FRAME: e // FRAME])
        out.append(float(found[-1] + 1) * FRAME / RATE if len(found) else 0.0)
    return out


def windows(audio: np.ndarray, vad: Chunking,
            max_seconds: float = WINDOW_SECONDS) -> list[tuple[int, int]]:
    """Windows of at most ``max_seconds``, cut at pauses: consecutive stretches of speech
    join a window while it stays within the limit; a longer stretch is cut at its
    quietest frame in its last third (hop aligned)."""
    limit = int(max_seconds * RATE)
    out: list[tuple[int, int]] = []
    for s, e in speech_spans(audio, vad):
        while e - s > limit:
            lo, hi = s + 2 * limit // 3, s + limit
            frames = audio[lo:hi][: (hi - lo) // FRAME * FRAME].reshape(-1, FRAME)
            cut = lo + int(np.argmin(np.abs(frames).mean(axis=1))) * FRAME
            cut = cut if cut > s else s + limit
            _join(out, s, cut, limit)
            s = cut
        _join(out, s, e, limit)
    return out


def _join(out: list[tuple[int, int]], s: int, e: int, limit: int) -> None:
    if out and e - out[-1][0] <= limit:
        out[-1] = (out[-1][0], e)
    else:
        out.append((s, e))


def use_batched(request: TranscriptionRequest) -> bool:
    """The request's chunking: ``default`` batches a recording longer than one window."""
    if request.chunking.mode == "default":
        return len(request.audio) > WINDOW_SECONDS * RATE
    return request.chunking.mode == "batched"


class Upload:
    """One recording's windows on their way through the shared batch (``WindowBatcher``).

    Built on the event loop's side with the request; everything that touches the model
    (``prepare``, ``take``) runs on the worker thread. Its windows are decoded in order
    (a batch takes each upload's next windows and finishes before the next batch), so
    ``take`` sees them in order and ``on_window`` streams them in order.
    """

    def __init__(self, request: TranscriptionRequest, check_language: Callable[[], str | None],
                 temperatures: tuple[float, ...], on_window: Callable[[str], None] | None,
                 token: CancelToken) -> None:
        self.request = request
        self.temperatures = temperatures
        self.on_window = on_window
        self.token = token
        self.reply: Reply[dict[str, Any]] = Reply()  # mlx-whisper's result dict
        self.arrived = time.monotonic()
        self._check_language = check_language
        self.prepared = False
        self.cuts: list[tuple[int, int]] = []
        self.speech_ends: list[float] = []  # per window: where its speech ends (s)
        self.picked = 0  # windows handed to a batch
        self.taken = 0  # windows whose result is in
        self.options: Any = None
        self.tokenizer: Any = None
        self.fp16 = False
        self.audio = np.zeros(0, np.float32)
        self.language = "en"
        self._segments: list[dict[str, Any]] = []
        self._texts: list[str] = []
        self._last_speech = 0.0

    @property
    def gone(self) -> bool:
        """Its caller gave up (client gone, unload)."""
        return self.token.cancelled or self.reply.cancelled

    @property
    def done(self) -> bool:
        return self.prepared and self.taken == len(self.cuts)

    @property
    def key(self) -> tuple[Any, ...]:
        """Uploads share a batch only when they decode with the same options."""
        return (self.request.task, self.language, self.request.prompt, self.temperatures)

    def prepare(self, model: Any) -> None:
        """Cut the recording at its pauses; detect the language on its first window
        (as mlx-whisper's ``transcribe`` does) unless the request names it."""
        from mlx_whisper.decoding import DecodingOptions
        from mlx_whisper.tokenizer import get_tokenizer

        language = self._check_language()
        self.fp16 = model.encoder.conv1.weight.dtype == mx.float16
        self.audio = np.asarray(self.request.audio, dtype=np.float32)
        self.cuts = windows(self.audio, self.request.chunking)
        self.speech_ends = speech_ends(self.audio, self.request.chunking, self.cuts)
        if language is None and self.cuts:
            _, probs = model.detect_language(self.mel(model, 0))
            language = str(max(probs, key=probs.get))
        self.language = language or "en"
        self.tokenizer = get_tokenizer(model.is_multilingual, num_languages=model.num_languages,
                                       language=self.language, task=self.request.task)
        self.options = DecodingOptions(task=self.request.task, language=self.language,
                                       fp16=self.fp16, prompt=self.request.prompt or None)
        self.prepared = True

    def mel(self, model: Any, index: int) -> mx.array:
        """Window ``index``'s log-mel spectrogram, padded to 30 s."""
        from mlx_whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim

        s, e = self.cuts[index]
        mel = log_mel_spectrogram(self.audio[s:e], n_mels=model.dims.n_mels, padding=N_SAMPLES)
        return pad_or_trim(mel, N_FRAMES, axis=-2).astype(mx.float16 if self.fp16
                                                           else mx.float32)

    def take(self, model: Any, mel: mx.array, result: Any) -> None:
        """The next window's decoded result: its segments at absolute times (word timings
        from the cross-attention), its text to ``on_window``. A window Whisper scores as
        no speech (and improbable) yields nothing, as in the sequential loop."""
        from mlx_whisper.timing import add_word_timestamps

        span = self.cuts[self.taken]
        self.taken += 1
        if result.no_speech_prob > NO_SPEECH_MIN and result.avg_logprob < LOGPROB_MIN:
            return
        window = _segments(result, self.tokenizer, span)
        if self.request.word_timestamps and window:
            add_word_timestamps(segments=window, model=model, tokenizer=self.tokenizer,
                                mel=mel, num_frames=(span[1] - span[0]) // 160,
                                last_speech_timestamp=self._last_speech)
            words_end = [w["end"] for s in window for w in s.get("words") or []]
            self._last_speech = max(words_end, default=self._last_speech)
        self._segments.extend(window)
        text = "".join(s["text"] for s in window)
        self._texts.append(text)
        if self.on_window is not None and text.strip():
            self.on_window(text)

    def result(self) -> dict[str, Any]:
        """mlx-whisper's result dict: ``text``, ``segments``, ``language``."""
        for i, seg in enumerate(self._segments):
            seg["id"] = i
        return {"text": "".join(self._texts), "segments": self._segments,
                "language": self.language}


def decode_batch(model: Any, mels: list[mx.array], options: Any,
                 temperatures: tuple[float, ...],
                 check_cancelled: Callable[[], None],
                 speech_ends: list[float] | None = None) -> list[Any]:
    """The windows' ``DecodingResult``s, decoded as one batch with temperature fallback;
    ``check_cancelled`` runs before each window's encoder pass and at every decoding step,
    and may raise to stop the batch. ``speech_ends``: where each window's speech ends
    (seconds), to keep a window from ending before it (``SpeechLeft``).

    The encoder runs window by window (each evaluated before the next): MLX is lazy, so a
    batch of 8 windows through the encoder was one uninterruptible evaluation (21 s on
    this 2-core CPU under load: an unload waited for it), and its attention scores 8x the
    peak of one window. ``DecodingTask`` takes encoded features in place of a
    spectrogram, so the features are computed once and reused by every fallback pass."""
    from mlx_whisper.decoding import DecodingTask, LogitFilter

    class Cancellable(LogitFilter):
        """Checks for cancellation at every decoding step (logits pass unchanged), so
        a cancelled batch stops within one token, not one whole decode."""

        def apply(self, logits: mx.array, tokens: mx.array) -> mx.array:
            check_cancelled()
            return logits

    class SpeechLeft(LogitFilter):
        """No end of text while the voice-activity detector heard speech more than
        ``SPEECH_LEFT_S`` after the row's last timestamp.

        Whisper learnt on 30-s chunks cut anywhere, so it often ends a window with a
        lone timestamp before its last sentence, leaving that sentence to the next
        window (mlx-whisper's sequential loop seeks back to that timestamp). Batched
        windows have no next window to carry it: measured on 60 s of Piper speech with
        pauses, the last sentence of 1 or 2 windows in 3 went missing (19% WER against
        3.4% sequential). With the end of text forbidden there, the model writes the
        sentence; the timestamp rules still decide where segments close."""

        def __init__(self, tokenizer: Any, ends: list[float]) -> None:
            self.eot = tokenizer.eot
            self.begin = tokenizer.timestamp_begin
            self.ends = ends

        def apply(self, logits: mx.array, tokens: mx.array) -> mx.array:
            rows = np.asarray(tokens)
            stamps = np.where(rows >= self.begin, rows - self.begin, -1).max(axis=1) * 0.02
            left = np.asarray(self.ends[: len(rows)]) - np.maximum(stamps, 0.0) > SPEECH_LEFT_S
            if not left.any():
                return logits
            eot = mx.arange(logits.shape[-1]) == self.eot
            return mx.where(mx.array(left)[:, None] & eot[None, :], -mx.inf, logits)

    def decode(model: Any, mel: mx.array, options: Any, ends: list[float] | None) -> Any:
        task = DecodingTask(model, options)
        if ends is not None:
            task.logit_filters.append(SpeechLeft(task.tokenizer, ends))
        task.logit_filters.append(Cancellable())
        return task.run(mel)

    features = []
    for mel in mels:
        check_cancelled()
        encoded = model.encoder(mel[None])
        mx.eval(encoded)
        features.append(encoded[0])
    return _decode_with_fallback(decode, options, model, features, temperatures,
                                 check_cancelled, speech_ends)


def _decode_with_fallback(decode: Any, base: Any, model: Any, mels: list[mx.array],
                          temperatures: tuple[float, ...],
                          check_cancelled: Callable[[], None] = lambda: None,
                          speech_ends: list[float] | None = None) -> list[Any]:
    """Each window's result at the first temperature it does not fail at (the failing
    windows of the batch decoded again together); ``check_cancelled`` runs before each
    pass, so a cancelled job stops within one batched decode."""
    from dataclasses import replace

    results: list[Any] = [None] * len(mels)
    pending = list(range(len(mels)))
    for t in temperatures:
        check_cancelled()
        batch = mx.stack([mels[i] for i in pending])
        ends = None if speech_ends is None else [speech_ends[i] for i in pending]
        decoded = decode(model, batch, replace(base, temperature=t), ends)
        retry = []
        for i, r in zip(pending, decoded, strict=True):
            results[i] = r
            failed = (r.compression_ratio > COMPRESSION_RATIO_MAX
                      or r.avg_logprob < LOGPROB_MIN)
            if failed and not r.no_speech_prob > NO_SPEECH_MIN:
                retry.append(i)
        pending = retry
        if not pending:
            break
    return results


def _segments(result: Any, tokenizer: Any, span: tuple[int, int]) -> list[dict[str, Any]]:
    """The window's timestamp-delimited segments at absolute times (clamped to the
    window): ``<|t0|> text <|t1|>`` pairs; text after the last timestamp runs to the
    window's end; no timestamp at all, one segment for the window."""
    begin = tokenizer.timestamp_begin
    offset, end_of_window = span[0] / RATE, (span[1] - span[0]) / RATE
    out: list[dict[str, Any]] = []
    start: float | None = None
    text_tokens: list[int] = []
    pieces: list[tuple[float, float, list[int]]] = []
    for tok in result.tokens:
        if tok >= begin:
            t = min((tok - begin) * 0.02, end_of_window)
            if start is not None and text_tokens:
                pieces.append((start, t, text_tokens))
                text_tokens = []
                start = None
            else:
                start = t
        elif tok < tokenizer.eot:
            if start is None:
                start = pieces[-1][1] if pieces else 0.0
            text_tokens.append(tok)
    if text_tokens:
        pieces.append((start or 0.0, end_of_window, text_tokens))
    for s, e, toks in pieces:
        out.append({"seek": span[0] // 160, "start": offset + s, "end": offset + max(s, e),
                    "text": tokenizer.decode(toks), "tokens": toks,
                    "temperature": result.temperature, "avg_logprob": result.avg_logprob,
                    "compression_ratio": result.compression_ratio,
                    "no_speech_prob": result.no_speech_prob})
    return out
