"""``WindowBatcher``: concurrent uploads to one Whisper model share its batches.

A long recording is cut at its pauses into windows that Whisper decodes as one
batch (``stt_batched.py``). Uploads that arrive together are windows too: the
batcher is the model worker's ``Stepper``, as the text scheduler is, and each
step takes up to ``SPEECH_BATCH_WINDOWS`` windows (the number the model's memory
estimate reserves activations for, so sharing never raises the peak) from every
waiting upload that decodes with the same options, one window from each in
turn, oldest upload first, and runs them through the encoder and the token loop
together. An upload that arrives while a batch runs joins the next one; a batch
with room waits ``GATHER_S`` after a new upload's arrival for others sent with it. Each
upload's windows go in order (a batch takes its next ones), so streaming sends
them in order as their batch ends.

An upload whose caller gives up (client gone, unload) stops there: its windows
not yet decoded are dropped, and a batch all of whose uploads left stops at its
next token; a batch shared with a live upload runs on for it.

``submit`` runs on the event loop's thread; ``step`` and ``fail_all`` on the worker.
Each upload's result goes back through its ``Reply`` (``runtime/channel.py``): the
uploads a batch finishes are handed over with one thread hop per event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.engines.audio.stt_batched import BATCH_SIZE, Upload, decode_batch
from mlxd.errors import Overloaded
from mlxd.runtime.channel import Failure, Reply, send_all
from mlxd.runtime.worker import JobCancelled

log = logging.getLogger(__name__)
# How long a batch with room waits after an upload arrives, for uploads sent with it: a
# small part of one window's decode (seconds on a CPU, a few hundred ms on a GPU).
GATHER_S = 0.2


class WindowBatcher:
    """The waiting uploads of one Whisper model and the batches that decode them."""

    def __init__(self, model: Any, wake: Callable[[], None],
                 batch_size: int = BATCH_SIZE, gather_s: float = GATHER_S) -> None:
        self.model = model
        self.batch_size = batch_size
        self.gather_s = gather_s
        self._wake = wake
        self._lock = threading.Lock()
        self._uploads: list[Upload] = []  # arrival order
        self._closed = False
        self.step_error: BaseException | None = None
        self._counts = {"batches": 0, "batched_windows": 0, "shared_batches": 0,
                        "most_uploads_in_a_batch": 0, "batch_seconds": 0.0}

    # -- event loop side ----------------------------------------------------------------
    def submit(self, upload: Upload) -> Reply[dict[str, Any]]:
        """Queue ``upload``; its reply gets mlx-whisper's result dict."""
        with self._lock:
            if self._closed:
                raise Overloaded("The model is being unloaded; retry shortly.", retry_after=2)
            self._uploads.append(upload)
        self._wake()
        return upload.reply

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counts, "queued_uploads": len(self._uploads)}

    # -- worker side --------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._uploads)

    def step(self) -> None:
        """Decode one batch of windows (worker thread)."""
        group = self._ready_group()
        if not group:
            return
        fresh = [u.arrived for u in group if u.picked == 0]
        if fresh and sum(len(u.cuts) - u.picked for u in group) < self.batch_size:
            # Room in the batch and an upload just arrived: uploads sent together reach
            # the batcher a few tens of ms apart (each is read and decoded first), so
            # wait that long for them rather than start the batch without them.
            time.sleep(max(0.0, min(fresh) + self.gather_s - time.monotonic()))
            group = self._ready_group()
            if not group:
                return
        picks = self._pick(group)
        uploads = list(dict.fromkeys(u for u, _ in picks))
        started = time.monotonic()
        try:
            self._decode(picks, uploads, group[0])
        except JobCancelled as e:
            self._finish_all([(u, Failure(e)) for u in uploads])
            return
        except Exception as e:  # fail this batch's uploads, keep serving the others
            log.exception("speech batch of %d windows failed", len(picks))
            self.step_error = e
            self._finish_all([(u, Failure(e)) for u in uploads])
            return
        finally:
            # The batch's freed buffers go back to the system, not MLX's cache, where
            # the memory budget would not see them between requests.
            mx.clear_cache()
        self.step_error = None
        self._count(picks, uploads, time.monotonic() - started)
        self._finish_all([(u, u.result()) for u in uploads if u.done])

    def _decode(self, picks: list[tuple[Upload, int]], uploads: list[Upload],
                first: Upload) -> None:
        def all_gone() -> None:  # per decoding step: stop only when nobody waits
            if all(u.gone for u in uploads):
                raise JobCancelled()

        mels = [u.mel(self.model, i) for u, i in picks]
        results = decode_batch(self.model, mels, first.options, first.temperatures, all_gone,
                               [u.speech_ends[i] for u, i in picks])
        order = sorted(range(len(picks)), key=lambda k: (uploads.index(picks[k][0]),
                                                         picks[k][1]))
        for k in order:
            upload = picks[k][0]
            if not upload.reply.done and not upload.gone:
                self._take(upload, mels[k], results[k])

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            uploads = list(self._uploads)
        self._finish_all([(u, Failure(error)) for u in uploads])

    def close(self) -> None:
        """Refuse new uploads and fail the waiting ones (the model is unloading)."""
        with self._lock:
            self._closed = True
        self.fail_all(Overloaded("The model was unloaded before this upload was "
                                 "transcribed; retry.", retry_after=1))

    # -- internals ------------------------------------------------------------------------
    def _ready_group(self) -> list[Upload]:
        """Live uploads with windows to decode that share the oldest one's options;
        finishes the gone, the failed and the empty on the way."""
        with self._lock:
            uploads = list(self._uploads)
        live: list[Upload] = []
        for u in uploads:
            if u.gone:
                self._finish(u, error=JobCancelled())
                continue
            if not u.prepared:
                try:
                    u.prepare(self.model)
                except Exception as e:  # a language the model does not speak, ...
                    self._finish(u, error=e)
                    continue
            if u.done:  # no speech to decode
                self._finish(u, result=u.result())
            else:
                live.append(u)
        return [u for u in live if u.key == live[0].key] if live else []

    def _pick(self, group: list[Upload]) -> list[tuple[Upload, int]]:
        """Up to ``batch_size`` windows, one from each upload in turn, oldest first."""
        picks: list[tuple[Upload, int]] = []
        while len(picks) < self.batch_size:
            before = len(picks)
            for u in group:
                if u.picked < len(u.cuts) and len(picks) < self.batch_size:
                    picks.append((u, u.picked))
                    u.picked += 1
            if len(picks) == before:
                break
        return picks

    def _take(self, upload: Upload, mel: mx.array, result: Any) -> None:
        try:
            upload.take(self.model, mel, result)
        except Exception as e:  # word timings of one window failed: that upload only
            log.exception("speech window of one upload failed")
            self._finish(upload, error=e)

    def _finish(self, upload: Upload, result: dict[str, Any] | None = None,
                error: BaseException | None = None) -> None:
        self._finish_all([(upload, Failure(error) if error is not None else result or {})])

    def _finish_all(self, outcomes: list[tuple[Upload, dict[str, Any] | Failure]]) -> None:
        """Take the uploads out of the queue and hand each its result dict or
        ``Failure`` (one thread hop per event loop; an upload whose caller left drops it)."""
        with self._lock:
            for upload, _ in outcomes:
                if upload in self._uploads:
                    self._uploads.remove(upload)
        send_all((upload.reply, outcome) for upload, outcome in outcomes)

    def _count(self, picks: list[tuple[Upload, int]], uploads: list[Upload],
               seconds: float) -> None:
        with self._lock:
            c = self._counts
            c["batches"] += 1
            c["batched_windows"] += len(picks)
            c["shared_batches"] += len(uploads) > 1
            c["most_uploads_in_a_batch"] = max(c["most_uploads_in_a_batch"], len(uploads))
            c["batch_seconds"] += seconds
