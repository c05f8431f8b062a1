"""``stream=true`` transcriptions: ``transcript.text.delta`` events as the model decodes.

The engine calls ``on_text`` from its worker thread with each segment (Whisper) or
window (other families) as soon as it is decoded; those pieces cross to the event loop
through an ``asyncio.Queue`` and go out as deltas. The response starts only once the
first piece has arrived or the job has ended, so a refusal the engine makes at the start
(a language the model does not speak) is still a plain 4xx. Then
``transcript.text.done`` carries the text, which is exactly the deltas concatenated. The
lease is held until the stream ends; a client that goes away ends it, and cancels the
job, which stops before its next window (so an unload that follows finds the engine idle).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from mlxd.engines.base import Transcriber, Transcription, TranscriptionRequest
from mlxd.models.manager import ModelLease
from mlxd.runtime.channel import LoopChannel
from mlxd.server.disconnect import unless_disconnected
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.sse import SSE_HEADERS, sse_data
from mlxd.server.transcript_formats import usage

OnClose = Callable[[], Awaitable[None]]


class _Pieces:
    """Text pieces from the worker thread, and the job that makes them."""

    def __init__(self, engine: Transcriber, job: TranscriptionRequest) -> None:
        self.pieces: LoopChannel[str] = LoopChannel()  # sent from the worker thread
        self.task: asyncio.Future[Transcription] = asyncio.ensure_future(
            engine.transcribe(job, self.pieces.send))
        # A client that left before the end: the job's outcome is still retrieved.
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def stop(self) -> None:
        """Cancel the job if it still runs (the worker stops it before its next window)."""
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def next(self) -> str | None:
        """The next piece, or None once the job has ended (raising its error, if any)."""
        if self.pieces.pending():
            return self.pieces.receive_nowait()
        if not self.task.done():
            getter = asyncio.ensure_future(self.pieces.receive())
            waiting: set[asyncio.Future[Any]] = {getter, self.task}
            try:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:  # this read itself cancelled (its client left): no getter left pending
                if not getter.done():
                    getter.cancel()
            if getter in done:
                return getter.result()
            if self.pieces.pending():
                return self.pieces.receive_nowait()
        self.task.result()
        return None


def _delta(text: str) -> str:
    return sse_data({"type": "transcript.text.delta", "delta": text})


async def _events(first: str | None, pieces: _Pieces) -> AsyncIterator[str]:
    sent = ""
    piece = first
    while piece is not None:
        delta = piece if sent else piece.lstrip()
        if delta:
            sent += delta
            yield _delta(delta)
        piece = await pieces.next()
    transcript = pieces.task.result()
    if transcript.text.startswith(sent) and len(transcript.text) > len(sent):
        rest = transcript.text[len(sent):]
        sent += rest
        yield _delta(rest)
    yield sse_data({"type": "transcript.text.done", "text": sent, "usage": usage(transcript)})


def _error(error: StreamError) -> str:
    return sse_data({"type": "error", "error": {"message": error.message, "type": error.type,
                                                "param": error.param, "code": error.code}})


async def _nothing() -> None:
    pass


async def stream_transcription(request: Request, lease: ModelLease[Transcriber],
                               job: TranscriptionRequest,
                               on_close: OnClose = _nothing) -> StreamingResponse:
    """The SSE response; raises (a plain error response) if the job fails before its
    first piece, or ``ClientDisconnect`` if the client leaves first (a recording that
    gives no text for minutes gives no piece). Takes ownership of ``lease``;
    ``on_close`` runs once the stream ends (or fails to start)."""
    pieces: _Pieces | None = None

    async def release() -> None:
        if pieces is not None:
            await pieces.stop()  # a client that left: the job stops before its next window
        await lease.release()
        await on_close()

    try:
        pieces = _Pieces(lease.engine, job)
        first = await unless_disconnected(request, pieces.next())
    except BaseException:
        await release()
        raise
    body: Any = leased_stream(_events(first, pieces), release, _error, "transcription failed")
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
