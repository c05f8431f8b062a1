"""The one way a model's worker thread streams results to the event loop.

Model code runs on its worker thread (``runtime/worker.py``); the request that waits
for it runs on an asyncio event loop. A ``LoopChannel`` joins the two for a stream of
items: the worker sends (any thread), one coroutine on the loop receives, in order.
Text generation sends each step's events through it, a streamed transcription each
piece of text. ``send_all`` hands a whole batch over with one thread hop per event
loop, however many channels it feeds (each hop wakes the loop and costs CPU). A single
result, not a stream, is the future ``ModelWorker.run`` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LoopChannel(Generic[T]):
    """Items from any thread to one consumer on ``loop`` (the running loop by default)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self._queue: asyncio.Queue[T] = asyncio.Queue()

    def send(self, item: T) -> None:
        """Queue ``item`` for the consumer (any thread; dropped once the loop is closed)."""
        send_all([(self, item)])

    async def receive(self) -> T:
        """The next item, waiting for it (on the loop)."""
        return await self._queue.get()

    def pending(self) -> bool:
        """Whether an item is already waiting (on the loop)."""
        return not self._queue.empty()

    def receive_nowait(self) -> T:
        """The next item; ``asyncio.QueueEmpty`` when none is waiting (on the loop)."""
        return self._queue.get_nowait()


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def send_all(batch: Iterable[tuple[LoopChannel[Any], Any]]) -> None:
    """Send each ``(channel, item)`` of ``batch``, with one thread hop per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
    for channel, item in batch:
        by_loop.setdefault(channel.loop, []).append((channel._queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # loop closed: its consumers are long gone
            pass
