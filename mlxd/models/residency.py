"""``ResidencyManager``: the lifecycle of one model.

States: unloaded -> loading -> loaded -> unloading -> unloaded, plus failed
(with the last error). Concurrent first requests share one load; leases
block idle unload and eviction; unload first runs the engine's persist hook
(e.g. the prefix cache), then closes the engine and its worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from mlxd.engines.worker import ModelWorker
from mlxd.errors import MlxdError, ModelLoadError
from mlxd.models.spec import ModelEntry, ModelKind

log = logging.getLogger(__name__)


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

    def __init__(self, engine: Any, worker: ModelWorker) -> None:
        self.engine = engine
        self.worker = worker


# (entry, kind, worker) -> engine. Blocking: runs on the model's own (daemon)
# worker thread, so a shutdown never waits for a slow load or download.
Loader = Callable[[ModelEntry, ModelKind, ModelWorker], Any]


class ResidencyManager:
    """State machine of one registered model. All methods run on the event loop."""

    def __init__(self, entry: ModelEntry, kind: ModelKind, estimate: int, loader: Loader,
                 reserve: int = 0, on_change: Callable[[], Awaitable[None]] | None = None,
                 load_gate: asyncio.Lock | None = None) -> None:
        self.entry = entry
        self.kind = kind
        self.estimate = estimate
        self.reserve = reserve
        self._loader = loader
        self._on_change = on_change
        self._load_gate = load_gate  # one load at a time per device
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
        self._load_task: asyncio.Task[LoadedModel] | None = None
        self._unload_task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def engine(self) -> Any:
        return self.loaded.engine if self.loaded else None

    @property
    def pinned(self) -> bool:
        return self.entry.pinned

    def accounted_bytes(self) -> int:
        """Bytes this model holds against the budget (0 when unloaded)."""
        if self.state in (State.UNLOADED, State.FAILED):
            return 0
        if self.state == State.LOADING or self.measured_bytes is None:
            return self.estimate
        live = self.measured_bytes
        if self.loaded is not None:
            try:
                live = self.loaded.engine.memory_bytes()
            except Exception:
                pass
        return max(self.measured_bytes + self.reserve, live)

    def memory_bytes(self) -> int:
        """Estimate while unloaded, measured figure while loaded (for /v1/models)."""
        return self.accounted_bytes() if self.state == State.LOADED else self.estimate

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
        t0 = time.monotonic()
        worker = ModelWorker(self.name)
        worker.start()
        try:
            engine = await worker.run(self._loader, self.entry, self.kind, worker)
        except BaseException as e:
            worker.stop(timeout=0)
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
        await self._notify()
        return loaded

    def _fail(self, message: str) -> None:
        self.state = State.FAILED
        self.last_error = message
        self.loaded = None

    # -- unload -----------------------------------------------------------
    async def unload(self) -> None:
        """Persist eligible state, close the engine, stop its thread."""
        if self._unload_task is not None and not self._unload_task.done():
            await asyncio.shield(self._unload_task)
            return
        if self.state != State.LOADED or self.loaded is None:
            return
        self._unload_task = asyncio.get_running_loop().create_task(self._unload())
        await asyncio.shield(self._unload_task)

    async def _unload(self) -> None:
        loaded = self.loaded
        assert loaded is not None
        self.state = State.UNLOADING
        await self._notify()
        try:
            persist = getattr(loaded.engine, "persist_state", None)
            if persist is not None:
                try:
                    await loaded.worker.run(persist)
                except Exception:
                    log.exception("model %s: persisting state before unload failed", self.name)
            await self._close(loaded)
        finally:
            self.loaded = None
            self.measured_bytes = None
            self.state = State.UNLOADED
            await self._notify()

    @staticmethod
    async def _close(loaded: LoadedModel, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(loaded.worker.run(loaded.engine.close), timeout)
        except Exception:
            log.exception("closing engine failed")
        await asyncio.to_thread(loaded.worker.stop, 5.0)

    async def shutdown(self, timeout: float = 8.0) -> None:
        """Close the engine whatever is happening; never hang past ``timeout``."""
        task = self._load_task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except BaseException:
                pass
        if self._unload_task is not None and not self._unload_task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._unload_task), timeout)
            except BaseException:
                pass
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            try:
                await asyncio.wait_for(self._close(loaded, timeout), timeout + 6)
            except BaseException:
                log.warning("model %s did not close within %.0fs", self.name, timeout)
        self.state = State.UNLOADED

    async def _notify(self) -> None:
        if self._on_change is not None:
            await self._on_change()
