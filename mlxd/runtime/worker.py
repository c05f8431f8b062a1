"""One worker thread per loaded model: all of its MLX work runs there.

MLX streams are bound to the thread that created them, and model code must
never run on the asyncio event loop. The worker runs submitted jobs and, when
a stepper (a scheduler) has work, advances it one step between jobs. A job's
result goes back to its caller through a ``Reply`` (``runtime/channel.py``); a
job whose caller left before it started is skipped.

A long job (a transcription) is *cancellable*: ``run_cancellable`` hands it a
``CancelToken`` that it checks between windows, and sets it when its caller
gives up (client gone) or when ``cancel_jobs`` is called (unload, shutdown),
so the thread is free again within one window instead of at the end.

Threads outlive their workers: MLX gives each thread that runs an op its own
default stream, backed by a native thread that lives as long as the process,
so one OS thread per load would leak one native thread per load/unload cycle.
An ended worker's thread parks in ``WorkerThreads`` and the next worker
adopts it (with its streams) instead of starting a new one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from mlxd.errors import Overloaded
from mlxd.runtime.channel import Reply

log = logging.getLogger(__name__)
T = TypeVar("T")


class Stepper(Protocol):
    def has_work(self) -> bool: ...

    def step(self) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...


_STOP = object()
THREAD_PREFIX = "mlxd-model-"
IDLE_THREAD = "mlxd-idle-worker"

# Whole-batch step failures in a row after which a model counts as broken
# (one failure can be a bad request; several in a row fail everyone).
FAILING_AFTER = 3


class JobCancelled(Overloaded):
    """A cancellable job stopped early: its caller gave up, or the model is unloading."""

    def __init__(self) -> None:
        super().__init__("The request was cancelled: the model is unloading or the server "
                         "is shutting down; retry.", retry_after=1, code="cancelled")


class CancelToken:
    """Set by the event loop's side, checked by a job on the worker thread."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``JobCancelled`` once cancelled (call it between windows / batches)."""
        if self._event.is_set():
            raise JobCancelled()


def running_workers() -> list[str]:
    """Names of model worker threads still running (e.g. a load shutdown abandoned)."""
    return [t.name.removeprefix(THREAD_PREFIX) for t in threading.enumerate()
            if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


class WorkerThreads:
    """Threads of ended workers, parked until a new worker adopts one (one per manager)."""

    def __init__(self) -> None:
        self._parked: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def run(self, name: str, target: Callable[[], None]) -> None:
        """Run ``target`` on a parked thread (renamed ``name``), or on a new one."""
        with self._lock:
            inbox = self._parked.pop() if self._parked else None
        if inbox is not None:
            inbox.put(lambda: self._host(name, target))
            return
        threading.Thread(target=self._serve, args=(name, target), name=name, daemon=True).start()

    def _serve(self, name: str, target: Callable[[], None]) -> None:
        inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        job: Callable[[], None] = lambda: self._host(name, target)  # noqa: E731
        while True:
            job()
            threading.current_thread().name = IDLE_THREAD
            with self._lock:
                self._parked.append(inbox)
            job = inbox.get()

    @staticmethod
    def _host(name: str, target: Callable[[], None]) -> None:
        threading.current_thread().name = name
        target()


class ModelWorker:
    """A thread that owns one model. Jobs run in submission order."""

    def __init__(self, name: str, threads: WorkerThreads | None = None,
                 budget: Callable[[], tuple[int, int]] | None = None) -> None:
        self.name = name
        # (memory budget, bytes other models hold) from the ModelManager, read from this
        # thread: an engine sizes what it may grow into (live KV) from it. None: unbounded.
        self.budget = budget
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stepper: Stepper | None = None
        self._threads = threads
        self._ident: int | None = None  # the hosting thread, once running
        self._ended = threading.Event()  # the run is over (the thread may live on, parked)
        self._stopping = threading.Event()
        self._started = False
        self.step_failures = 0  # consecutive whole-batch step failures
        self.last_step_error: str | None = None
        self.death: str | None = None  # why the thread died, if it did
        self._tokens: set[CancelToken] = set()  # cancellable jobs queued or running
        self._tokens_lock = threading.Lock()
        self._at_exit: list[Callable[[], None]] = []

    def start(self) -> None:
        if not self._started:
            self._started = True
            if self._threads is not None:
                self._threads.run(THREAD_PREFIX + self.name, self._run)
            else:
                threading.Thread(target=self._run, name=THREAD_PREFIX + self.name,
                                 daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._started and not self._ended.is_set()

    @property
    def dead(self) -> bool:
        """The thread ended without being asked to (nothing will run here again)."""
        return self.death is not None or (
            self._started and self._ended.is_set() and not self._stopping.is_set())

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

    def submit(self, fn: Callable[..., T], *args: Any) -> Reply[T]:
        """Run ``fn(*args)`` on the worker thread; its result comes back as a ``Reply``
        (awaited on the event loop, or ``result()`` off it)."""
        reply: Reply[T] = Reply()
        if self._stopping.is_set():
            reply.set_exception(RuntimeError(f"model worker '{self.name}' is stopped"))
            return reply
        self._jobs.put((fn, args, reply))
        return reply

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` for async callers: cancelling the caller skips a job not started."""
        return await self.submit(fn, *args)

    async def run_cancellable(self, fn: Callable[..., T], *args: Any) -> T:
        """``run(fn, *args, token)``: when the caller is cancelled (its client left), or
        ``cancel_jobs`` is called, ``token`` is set and ``fn`` stops at its next check."""
        return await self.wait_cancellable(lambda token: self.submit(fn, *args, token))

    async def wait_cancellable(self, start: Callable[[CancelToken], Reply[T]]) -> T:
        """The result of work a stepper runs for this caller: ``start(token)`` queues it
        and returns its reply; ``token`` is set as in ``run_cancellable``."""
        token = CancelToken()
        with self._tokens_lock:
            self._tokens.add(token)
        try:
            return await start(token)
        except asyncio.CancelledError:
            token.cancel()
            raise
        finally:
            with self._tokens_lock:
                self._tokens.discard(token)

    def cancel_jobs(self) -> int:
        """Cancel every cancellable job queued or running (unload, shutdown); how many."""
        with self._tokens_lock:
            tokens = list(self._tokens)
        for token in tokens:
            token.cancel()
        return len(tokens)

    def at_exit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker thread when it ends (e.g. hand back its MLX streams)."""
        self._at_exit.append(fn)

    def wake(self) -> None:
        """Nudge an idle worker so it looks at its stepper again."""
        self._jobs.put(None)

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to finish (after the current step) and wait for it."""
        self._stopping.set()
        self._jobs.put(_STOP)
        if self._started and threading.get_ident() != self._ident:
            self._ended.wait(timeout)
        return not self.alive

    def _run(self) -> None:
        self._ident = threading.get_ident()
        try:
            self._loop()
            self._exit_hooks()
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
        finally:
            self._ended.set()

    def _exit_hooks(self) -> None:
        for fn in reversed(self._at_exit):
            try:
                fn()
            except Exception:
                log.exception("model %s: worker exit hook failed", self.name)

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
        fn, args, reply = item
        if not reply.start():  # its caller left before it ran
            return
        try:
            value = fn(*args)
        except BaseException as e:
            reply.set_exception(e)
        else:
            reply.set_result(value)

    def _drain_cancelled(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None and item is not _STOP:
                item[2].cancel() or item[2].set_exception(
                    RuntimeError(f"model worker '{self.name}' stopped"))
