"""Work nobody waits for: stop a request's engine work when its client goes away.

Every route that awaits one long engine call (transcription, embeddings, rerank, a
non-streaming chat) runs it through ``unless_disconnected``: when the client disconnects
first, the call is cancelled, which the engine sees at its next step (a batch queue drops
the request's rows; a transcription stops before its next 30 s window), and the route
ends with ``ClientDisconnect`` (answered quietly: nobody is there to read it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

T = TypeVar("T")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and this
    raises ``ClientDisconnect``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()
