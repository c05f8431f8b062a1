"""One worker thread per loaded model: all of its MLX work runs there.

MLX streams are bound to the thread that created them, and model code must
never run on the asyncio event loop. The worker runs submitted jobs and, when
a stepper (a scheduler) has work, advances it one step between jobs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Stepper(Protocol):
    def has_work(self) -> bool: ...

    def step(self) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...


_STOP = object()
THREAD_PREFIX = "mlxd-model-"

# Whole-batch step failures in a row after which a model counts as broken
# (one failure can be a bad request; several in a row fail everyone).
FAILING_AFTER = 3


def running_workers() -> list[str]:
    """Names of model worker threads still running (e.g. a load shutdown abandoned)."""
    return [t.name.removeprefix(THREAD_PREFIX) for t in threading.enumerate()
            if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


class ModelWorker:
    """A thread that owns one model. Jobs run in submission order."""

    def __init__(self, name: str, budget: Callable[[], tuple[int, int]] | None = None) -> None:
        self.name = name
        # (memory budget, bytes other models hold) from the ModelManager, read from this
        # thread: an engine sizes what it may grow into (live KV) from it. None: unbounded.
        self.budget = budget
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stepper: Stepper | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_PREFIX + name, daemon=True)
        self._stopping = threading.Event()
        self._started = False
        self.step_failures = 0  # consecutive whole-batch step failures
        self.last_step_error: str | None = None
        self.death: str | None = None  # why the thread died, if it did

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def dead(self) -> bool:
        """The thread ended without being asked to (nothing will run here again)."""
        return self.death is not None or (
            self._started and not self._thread.is_alive() and not self._stopping.is_set())

    def fault(self) -> str | None:
        """An engine-level fault that fails every request, or None when healthy."""
        if self.dead:
            return f"the model's worker thread died ({self.death or 'unknown cause'})"
        if self.step_failures >= FAILING_AFTER:
            return (f"the last {self.step_failures} batch steps in a row failed for their "
                    f"whole batch ({self.last_step_error})")
        return None

    def set_stepper(self, stepper: Stepper | None) -> None:
        self._stepper = stepper

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the worker thread; returns a future of its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping.is_set():
            fut.set_exception(RuntimeError(f"model worker '{self.name}' is stopped"))
            return fut
        self._jobs.put((fn, args, fut))
        return fut

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` for async callers."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def wake(self) -> None:
        """Nudge an idle worker so it looks at its stepper again."""
        self._jobs.put(None)

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to finish (after the current step) and wait for it."""
        self._stopping.set()
        self._jobs.put(_STOP)
        if self._started and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the thread is dying: record why, fail what waits
            self.death = f"{type(e).__name__}: {e}"
            self._stopping.set()  # later jobs fail at once instead of hanging
            log.critical("model %s: worker thread died: %s", self.name, self.death)
            stepper = self._stepper
            if stepper is not None:
                try:
                    stepper.fail_all(e)
                except BaseException:
                    log.exception("model %s: failing requests after the worker died", self.name)
            self._drain_cancelled()

    def _loop(self) -> None:
        while True:
            stepper = self._stepper
            busy = stepper is not None and stepper.has_work()
            try:
                item = self._jobs.get(block=not busy)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._drain_cancelled()
                    return
                self._run_job(item)
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    item = None
            stepper = self._stepper
            if stepper is not None and stepper.has_work() and not self._stopping.is_set():
                try:
                    stepper.step()
                except Exception as e:  # a broken step must not kill the worker
                    self._count_step(e)
                    log.exception("model %s: scheduler step failed", self.name)
                    stepper.fail_all(e)
                else:  # a stepper that fails a batch itself says so in ``step_error``
                    self._count_step(getattr(stepper, "step_error", None))

    def _count_step(self, error: BaseException | None) -> None:
        if error is None:
            self.step_failures = 0
        else:
            self.step_failures += 1
            self.last_step_error = f"{type(error).__name__}: {error}"

    @staticmethod
    def _run_job(item: Any) -> None:
        fn, args, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    def _drain_cancelled(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None and item is not _STOP:
                item[2].cancel() or item[2].set_exception(
                    RuntimeError(f"model worker '{self.name}' stopped"))
