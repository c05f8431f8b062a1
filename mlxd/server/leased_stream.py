"""The one wrapper every streamed response that holds a model goes through.

Once a streaming response has sent its status, two things must still happen however
the stream ends (it finished, it failed, the client went away): what it holds (a model
lease, a text session, a transcription job) is released, and an error is told to the
client in the API's own shape, since no status can carry it any more. Every route hands
its body to ``leased_stream`` with a ``release`` and, where its wire format has an error
event, an ``error_event`` that writes a ``StreamError`` in that shape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from mlxd.errors import MlxdError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class StreamError:
    """An exception raised after the status was sent, as what a client may be told."""

    message: str
    type: str  # OpenAI's error type: invalid_request_error, server_error...
    status: int
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: Exception, fallback: str) -> StreamError:
        """``error``'s own message and code when it is ours, else ``fallback`` (an
        unexpected error's text is for the log, not the client)."""
        if isinstance(error, MlxdError):
            return cls(error.message, error.error_type, error.status, error.param, error.code)
        return cls(fallback, "server_error", 500)


async def leased_stream(body: AsyncIterator[T], release: Callable[[], Awaitable[None]],
                        error_event: Callable[[StreamError], T] | None = None,
                        fallback: str = "generation failed") -> AsyncIterator[T]:
    """``body``'s items; then ``release()``, however the stream ends. An ``Exception``
    from ``body`` becomes one last item, ``error_event(...)``, when the API has an error
    event (raw audio has none: the error is raised and the response cut short)."""
    try:
        try:
            async for item in body:
                yield item
        except Exception as e:
            if error_event is None:
                raise
            log.warning("stream failed after its status was sent: %s: %s",
                        type(e).__name__, e)
            yield error_event(StreamError.of(e, fallback))
    finally:
        try:
            close = getattr(body, "aclose", None)
            if close is not None:  # a client that left: its generation stops here
                try:
                    await close()
                except Exception:
                    log.exception("closing a stream's body failed")
        finally:
            await release()
