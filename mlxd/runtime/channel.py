"""The one way a model's worker thread hands results to the event loop.

Model code runs on its worker thread (``runtime/worker.py``); the request that waits
for it runs on an asyncio event loop. Two shapes join the two:

- a ``LoopChannel`` carries a stream of items: the worker sends (any thread), one
  coroutine on the loop receives, in order (a text sequence's events, a streamed
  transcription's pieces);
- a ``Reply`` carries one result: the worker settles it with a value or an exception,
  one coroutine awaits it (a worker job's return value, an embedding request's rows,
  a transcribed upload, a sharded group's failure). Cancelling the awaiting coroutine
  cancels the reply: a job not yet started is skipped (``Reply.start`` says so), a
  result that comes later is dropped.

Both reach the loop through ``send_all``, with one thread hop per event loop per
batch, however many channels and replies it feeds (each hop wakes the loop and costs
CPU): a text step's events for every sequence, a batch of embeddings for every
request in it. Nothing else in mlxd calls ``call_soon_threadsafe``, wraps a
``concurrent.futures.Future`` or otherwise crosses from a thread to the loop
(``tests/test_layering.py`` checks).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Failure:
    """``send_all``'s item for a ``Reply`` that failed: its awaiter raises ``error``."""

    error: BaseException


_PENDING, _RUNNING, _DONE, _CANCELLED = "pending", "running", "done", "cancelled"


class Reply(Generic[T]):
    """One result from any thread to one waiter.

    Made on the event loop (the usual case), a coroutine there awaits it. Made off any
    loop (a test, a thread), ``result`` blocks for it. The worker settles it once, with
    ``set_result``, ``set_exception`` or, for many replies at once, ``send_all`` (a
    ``Failure`` item for an exception); a settled or cancelled reply ignores the rest.
    """

    def __init__(self) -> None:
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._settled = threading.Event()
        self._waiter: asyncio.Future[None] | None = None  # while a coroutine awaits

    # -- the worker's side (any thread) ----------------------------------------------
    def start(self) -> bool:
        """Mark the work as running; False when its waiter already left (skip the work)."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _RUNNING
            return self._state == _RUNNING

    def set_result(self, value: T) -> None:
        """Hand ``value`` to the waiter (dropped when it left or the reply is settled)."""
        send_all([(self, value)])

    def set_exception(self, error: BaseException) -> None:
        """Make the waiter raise ``error`` (dropped when it left or the reply is settled)."""
        send_all([(self, Failure(error))])

    # -- the waiter's side -------------------------------------------------------------
    def cancel(self) -> bool:
        """Cancel work not started yet (its waiter raises ``asyncio.CancelledError``);
        whether the reply is now cancelled (False once running or settled)."""
        if self._mark_cancelled() and self.loop is not None:
            _hop(self.loop, [(None, self)])
        return self._state == _CANCELLED

    @property
    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    @property
    def done(self) -> bool:
        """Settled or cancelled: nothing more will reach the waiter."""
        return self._settled.is_set()

    def result(self, timeout: float | None = None) -> T:
        """The value (or raise the exception), blocking this thread up to ``timeout``
        seconds (``TimeoutError``); never call it on the event loop."""
        if not self._settled.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        return self._outcome()

    def __await__(self) -> Generator[Any, None, T]:
        if self.loop is None:
            raise RuntimeError("this Reply was made off the event loop: use result()")
        if not self._settled.is_set():
            # Settled from now on, the hop that says so runs after this (on this loop).
            self._waiter = self.loop.create_future()
            try:
                yield from self._waiter.__await__()
            except asyncio.CancelledError:  # the waiter left: work not started is skipped
                self._mark_cancelled()
                raise
        return self._outcome()

    # -- internals -----------------------------------------------------------------------
    def _settle(self, item: Any) -> bool:
        """Store ``item`` (worker side); False when the reply is cancelled or settled."""
        with self._lock:
            if self._state not in (_PENDING, _RUNNING):
                return False
            if isinstance(item, Failure):
                self._error = item.error
            else:
                self._value = item
            self._state = _DONE
            self._settled.set()
        return True

    def _mark_cancelled(self) -> bool:
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
            self._settled.set()
        return True

    def _outcome(self) -> T:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def _arrive(self) -> None:
        """Wake the awaiting coroutine, if any, to read the outcome (on the loop)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # done: the consumer left
            waiter.set_result(None)


# What one hop carries: ``(queue, item)`` for a channel, ``(None, reply)`` for a reply.
_Arrivals = list[tuple["asyncio.Queue[Any] | None", Any]]


def _arrive_all(items: _Arrivals) -> None:
    for queue, item in items:
        if queue is None:
            item._arrive()
        else:
            queue.put_nowait(item)


def _hop(loop: asyncio.AbstractEventLoop, items: _Arrivals) -> None:
    try:
        loop.call_soon_threadsafe(_arrive_all, items)
    except RuntimeError:  # loop closed: its consumers are long gone
        pass


def send_all(batch: Iterable[tuple[LoopChannel[Any] | Reply[Any], Any]]) -> None:
    """Send each ``(channel or reply, item)`` of ``batch``, with one thread hop per event
    loop. A reply's item is its value, or a ``Failure``; a reply already settled or
    cancelled drops it, one made off any loop is settled here without a hop."""
    by_loop: dict[asyncio.AbstractEventLoop, _Arrivals] = {}
    for dest, item in batch:
        if isinstance(dest, Reply):
            if not dest._settle(item) or dest.loop is None:
                continue
            loop = dest.loop
            arrival: tuple[asyncio.Queue[Any] | None, Any] = (None, dest)
        else:
            loop = dest.loop
            arrival = (dest._queue, item)
        items = by_loop.get(loop)
        if items is None:
            items = by_loop[loop] = []
        items.append(arrival)
    for loop, items in by_loop.items():
        _hop(loop, items)
