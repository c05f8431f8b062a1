"""``ResidencyManager``: the lifecycle of one model.

States: unloaded -> loading -> loaded -> unloading -> unloaded, plus failed
(with the last error). Concurrent first requests share one load; leases
block idle unload and eviction; unload first runs the engine's persist hook
(e.g. the prefix cache), then closes the engine and its worker thread.

Races it closes: ``unload`` marks the model unloading synchronously and
refuses while a lease is held, so a request queued on the event loop either
gets its lease first (and the unload is skipped) or waits and reloads; a
load that finishes after ``shutdown`` or ``retire`` gave up on it closes its
own engine instead of going live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from enum import Enum

from mlxd.errors import MlxdError, ModelLoadError, Overloaded
from mlxd.models.engine import EngineFacts, EngineStats, ModelEngine
from mlxd.models.loading import Loader
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.runtime.worker import ModelWorker, WorkerThreads

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # for the engine's close job to start and finish on its worker
STOP_TIMEOUT_S = 5.0  # then for the worker thread to end


class State(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class LoadedModel:
    """What a load produces: the engine and the worker thread it lives on."""

    def __init__(self, engine: ModelEngine, worker: ModelWorker) -> None:
        self.engine = engine
        self.worker = worker


class LoadAbandoned(Exception):
    """The load finished after its residency gave up on it; the engine was closed."""


class _LoadJob:
    """One load on the worker thread: resolve the source, then build the engine.

    Both steps block and run on the model's own (daemon) worker thread, so a
    shutdown never waits for a slow download or conversion. Once ``abandon``ed
    (shutdown timed out, model removed), a load still resolving never builds
    its engine, and whatever the loader did build is closed on the worker
    thread itself, so it is never leaked even when no event loop is left to
    receive it.
    """

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._lock = threading.Lock()
        self._abandoned = False

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True

    def __call__(self, entry: ModelEntry, kind: ModelKind, worker: ModelWorker) -> ModelEngine:
        path = self._loader.resolve(entry)
        with self._lock:
            abandoned = self._abandoned
        if abandoned:
            log.warning("model %s: resolved after the load was abandoned; not building it",
                        entry.name)
            raise LoadAbandoned(entry.name)
        engine = self._loader.build(entry, kind, path, worker)
        with self._lock:
            if not self._abandoned:
                return engine  # handed over: the event loop side owns it from here
        log.warning("model %s: load finished after it was abandoned; closing it", entry.name)
        try:
            engine.close()
        except Exception:
            log.exception("model %s: closing an abandoned engine failed", entry.name)
        raise LoadAbandoned(entry.name)


class ResidencyManager:
    """State machine of one registered model. All methods run on the event loop."""

    def __init__(self, entry: ModelEntry, kind: ModelKind, estimate: int, loader: Loader,
                 reserve: int = 0, on_change: Callable[[], Awaitable[None]] | None = None,
                 load_gate: asyncio.Lock | None = None,
                 on_loaded: Callable[[str, float], None] | None = None,
                 threads: WorkerThreads | None = None,
                 budget: Callable[[], tuple[int, int]] | None = None) -> None:
        self.entry = entry
        self.kind = kind
        self.estimate = estimate
        self.reserve = reserve
        self._loader = loader
        self._on_change = on_change
        self._load_gate = load_gate  # one load at a time per device
        self._on_loaded = on_loaded  # load-time metrics
        self._threads = threads  # where a new worker finds a parked thread
        self._budget = budget  # (budget, bytes other models hold), handed to the engine
        self.state = State.UNLOADED
        self.loaded: LoadedModel | None = None
        self.last_error: str | None = None
        self.loads = 0
        self.leases = 0
        self.last_used: float | None = None
        self.loaded_at: float | None = None
        self.measured_bytes: int | None = None
        self.load_seconds: float | None = None
        self.draining = False
        self.retired = False  # unregistered or replaced: never leased or loaded again
        # requests in flight per LoRA adapter of this model, and the adapters being removed
        self.adapter_users: Counter[str] = Counter()
        self.removing_adapters: set[str] = set()
        # Idle seconds before unload set by a client (Ollama's keep_alive; inf: never),
        # ahead of the entry's ttl_seconds and the server's --idle-unload-seconds.
        self.keep_alive: float | None = None
        self._closing = False  # shutdown began
        self._job: _LoadJob | None = None
        self._load_task: asyncio.Task[LoadedModel] | None = None
        self._unload_task: asyncio.Task[None] | None = None
        self.close_timeout = CLOSE_TIMEOUT_S
        self.stop_timeout = STOP_TIMEOUT_S
        # (worker, bytes) of unloaded engines whose thread did not stop: still counted
        self._lingering: list[tuple[ModelWorker, int]] = []

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def engine(self) -> ModelEngine | None:
        return self.loaded.engine if self.loaded else None

    @property
    def pinned(self) -> bool:
        return self.entry.pinned

    def release_adapter(self, adapter: str | None) -> None:
        """A request that held LoRA adapter ``adapter`` (``ModelManager.hold_adapter``) ended."""
        if adapter is not None and self.adapter_users[adapter] > 0:
            self.adapter_users[adapter] -= 1

    def accounted_bytes(self) -> int:
        """Bytes this model holds against the budget (0 when unloaded), counting an
        earlier engine whose worker did not stop when it was unloaded."""
        return self._engine_bytes() + self.lingering_bytes()

    def lingering_bytes(self) -> int:
        """Bytes of unloaded engines whose worker threads still run (0 once they end)."""
        self._lingering = [(w, n) for w, n in self._lingering if w.alive]
        return sum(n for _, n in self._lingering)

    def _engine_bytes(self) -> int:
        if self.state in (State.UNLOADED, State.FAILED):
            return 0
        if self.state == State.LOADING or self.measured_bytes is None:
            return self.estimate
        live = self.live_bytes()
        return max(self.measured_bytes + self.reserve,
                   self.measured_bytes if live is None else live)

    def live_bytes(self) -> int | None:
        """What the loaded engine holds now, measured (None while not loaded, or when the
        engine cannot say because it is being unloaded under the caller). Any thread."""
        loaded = self.loaded
        if loaded is None:
            return None
        try:
            return int(loaded.engine.memory_bytes())
        except Exception:
            return None

    def memory_bytes(self) -> int:
        """Estimate while unloaded, measured figure while loaded (for /v1/models)."""
        return self.accounted_bytes() if self.state == State.LOADED else self.estimate

    def health(self) -> str | None:
        """Why this loaded model cannot serve (None when healthy or not loaded).

        Broken means an engine-level fault that would fail every request: its
        worker thread died, or the last few scheduler steps failed for the
        whole batch (see ``ModelWorker.fault``).
        """
        loaded = self.loaded
        if self.state != State.LOADED or loaded is None:
            return None
        return loaded.worker.fault()

    def facts(self) -> EngineFacts | None:
        """The loaded engine's facts (None while not loaded, or when the engine cannot say
        because it is being unloaded under the caller)."""
        loaded = self.loaded
        if self.state != State.LOADED or loaded is None:
            return None
        try:
            return loaded.engine.facts()
        except Exception:
            return None

    def stats(self) -> EngineStats | None:
        """The loaded engine's live counters (None while not loaded, or when the engine
        cannot say because it is being unloaded under the caller)."""
        loaded = self.loaded
        if self.state != State.LOADED or loaded is None:
            return None
        try:
            return loaded.engine.stats()
        except Exception:
            return None

    def worker_dead(self) -> bool:
        loaded = self.loaded
        return loaded is not None and self.state == State.LOADED and loaded.worker.dead

    def idle_for(self, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        return now - (self.last_used or self.loaded_at or now)

    # -- load -------------------------------------------------------------
    def start_load(self) -> asyncio.Task[LoadedModel]:
        """Begin loading (the caller reserved the memory); shared by every waiter."""
        if self._load_task is None or self._load_task.done():
            self.state = State.LOADING
            self.last_error = None
            self._load_task = asyncio.get_running_loop().create_task(self._load())
        return self._load_task

    async def wait_loaded(self) -> LoadedModel:
        task = self._load_task
        if self.state == State.LOADED and self.loaded is not None:
            return self.loaded
        if task is None:
            raise ModelLoadError(self.name, self.last_error or "not loading")
        return await asyncio.shield(task)

    async def _load(self) -> LoadedModel:
        if self._load_gate is None:
            return await self._load_now()
        async with self._load_gate:
            return await self._load_now()

    async def _load_now(self) -> LoadedModel:
        if self._closing or self.retired:  # gave up while waiting for the device
            raise await self._give_up()
        t0 = time.monotonic()
        worker = ModelWorker(self.name, self._threads, budget=self._budget)
        worker.start()
        self._job = job = _LoadJob(self._loader)
        try:
            engine = await worker.run(job, self.entry, self.kind, worker)
        except BaseException as e:
            job.abandon()  # a cancelled load must not leave an engine behind
            worker.stop(timeout=0)
            if isinstance(e, LoadAbandoned):
                raise await self._give_up() from None
            if isinstance(e, MlxdError):
                self._fail(e.message)
            elif isinstance(e, Exception):
                log.exception("model %s failed to load", self.name)
                self._fail(f"{type(e).__name__}: {e}")
                await self._notify()
                raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
            else:
                self._fail("load cancelled")
            await self._notify()
            raise
        loaded = LoadedModel(engine, worker)
        if self._closing or self.retired:
            # Shutdown or removal happened while the load ran: never go live.
            log.info("model %s: loaded after shutdown or removal began; closing it", self.name)
            await self._close(loaded)
            raise await self._give_up()
        self.loaded = loaded
        self.state = State.LOADED
        self.loads += 1
        self.loaded_at = time.monotonic()
        self.load_seconds = self.loaded_at - t0
        try:
            self.measured_bytes = int(loaded.engine.memory_bytes())
        except Exception:
            self.measured_bytes = self.estimate
        log.info("model %s loaded in %.1fs (%s)", self.name, self.load_seconds, self.kind)
        if self._on_loaded is not None:
            self._on_loaded(self.name, self.load_seconds)
        await self._notify()
        return loaded

    async def _give_up(self) -> Overloaded:
        """End a load that shutdown or removal overtook; the error its waiters get."""
        self._fail("load abandoned (shutdown or model removed)")
        await self._notify()
        return Overloaded(f"Model '{self.name}' was removed or the server is shutting down.",
                          retry_after=5)

    def _fail(self, message: str) -> None:
        self.state = State.FAILED
        self.last_error = message
        self.loaded = None

    # -- unload -----------------------------------------------------------
    async def unload(self) -> bool:
        """Persist eligible state, close the engine, stop its thread.

        Refused (False) while a lease is held. The check and the switch to
        ``unloading`` happen synchronously, before any await, so no request
        can take a lease on an engine that is about to close: one queued
        behind this call sees ``unloading`` and waits, then loads again.
        """
        if self._unload_task is not None and not self._unload_task.done():
            await asyncio.shield(self._unload_task)
            return True
        if self.state != State.LOADED or self.loaded is None or self.leases:
            return False
        self.state = State.UNLOADING
        self._unload_task = asyncio.get_running_loop().create_task(self._unload(self.loaded))
        await asyncio.shield(self._unload_task)
        return True

    async def retire(self) -> None:
        """Unload for good (unregister / replace): the caller marked it ``retired``.

        A load in flight is waited for; it closes its own engine on seeing
        ``retired``, so nothing stays loaded outside the manager's table.
        """
        self.retired = True
        task = self._load_task
        if task is not None and not task.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        await self.unload()

    async def _persist(self, loaded: LoadedModel) -> None:
        try:
            await loaded.worker.run(loaded.engine.persist_state)
        except Exception:
            log.exception("model %s: persisting state before unload failed", self.name)

    async def _unload(self, loaded: LoadedModel) -> None:
        await self._notify()
        held = self._engine_bytes()
        stopped = False
        try:
            try:  # behind a job that does not end, saving state would wait for ever
                await asyncio.wait_for(self._persist(loaded), self.close_timeout)
            except asyncio.TimeoutError:
                log.warning("model %s: saving state before unload did not finish within "
                            "%.0fs", self.name, self.close_timeout)
            stopped = await self._close(loaded)
        finally:
            if not stopped:  # the old engine may still hold its memory: keep counting it
                self._lingering.append((loaded.worker, held))
            self.loaded = None
            self.measured_bytes = None
            self.state = State.UNLOADED
            await self._notify()
        if not stopped:
            raise Overloaded(f"Model '{self.name}' was unloaded but its worker is still "
                             "running a job; its memory stays counted until the job ends.",
                             retry_after=5, code="unload_incomplete")

    async def _close(self, loaded: LoadedModel, timeout: float | None = None) -> bool:
        """Close the engine on its thread and stop the thread; whether the thread ended.

        No lease is held, so a cancellable job still running (its client left) is cancelled
        first: it stops before its next window and the close runs right after it.
        """
        loaded.worker.cancel_jobs()
        timeout = self.close_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(loaded.worker.run(loaded.engine.close), timeout)
        except asyncio.TimeoutError:  # its worker is still busy with a step or a job
            log.warning("model %s: closing its engine did not start and finish within %.0fs",
                        loaded.worker.name, timeout)
        except Exception:
            log.exception("closing engine failed")
        stopped = await asyncio.to_thread(loaded.worker.stop, self.stop_timeout)
        if not stopped:
            log.error("model %s: its worker did not stop within %.0fs of closing",
                      loaded.worker.name, self.stop_timeout)
        return stopped

    async def shutdown(self, timeout: float = 8.0) -> None:
        """Persist and close the engine whatever is happening; never hang past ``timeout``.

        A load still running after ``timeout`` is abandoned: its waiters get a
        503 and the worker thread closes the engine when the load ends.
        """
        self._closing = True
        task = self._load_task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except BaseException:
                pass
            if not task.done() and self._job is not None:
                log.warning("model %s: still loading at shutdown; it will be closed when the "
                            "load ends", self.name)
                self._job.abandon()
        if self._unload_task is not None and not self._unload_task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._unload_task), timeout)
            except BaseException:
                pass
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            try:
                await asyncio.wait_for(self._persist(loaded), timeout)
            except BaseException:
                log.warning("model %s: saving state at shutdown did not finish", self.name)
            try:
                await asyncio.wait_for(self._close(loaded, timeout), timeout + 6)
            except BaseException:
                log.warning("model %s did not close within %.0fs", self.name, timeout)
        self.state = State.UNLOADED

    async def _notify(self) -> None:
        if self._on_change is not None:
            await self._on_change()
