"""``ModelManager``: every loaded model of every kind under one memory budget.

* A request holds a ``ModelLease`` for its whole life (streaming included);
  a leased model is never evicted or idle-unloaded.
* Loading and eviction decisions are serialized under one lock; the load
  itself runs outside it (on the model's own thread), one load at a time.
* To make room, idle unpinned models are evicted least-recently-used first.
  When nothing can be evicted: ``wait`` (up to ``wait_timeout_s``) or
  ``fail`` at once, with 503 + Retry-After naming what holds the budget.
* A model that cannot fit even in an empty budget is a 507.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeGuard, TypeVar, overload

from mlxd.errors import Conflict, InsufficientStorage, InvalidRequest, ModelNotFound, Overloaded
from mlxd.models.engine import ModelEngine
from mlxd.models.memory import format_bytes
from mlxd.models.residency import Loader, ResidencyManager, State
from mlxd.models.spec import (
    Family,
    ModelEntry,
    ModelKind,
    alias_specificity,
    is_alias_pattern,
)
from mlxd.models.transient import TransientMemory
from mlxd.runtime.worker import WorkerThreads

log = logging.getLogger(__name__)

E = TypeVar("E")


def _any_engine(engine: object) -> TypeGuard[ModelEngine]:
    return isinstance(engine, ModelEngine)


# What an admin load leases: any kind, as the lifecycle every engine shares.
ANY_FAMILY: Family[ModelEngine] = Family("any", frozenset(ModelKind), _any_engine)

# kind -> why this install cannot serve it (None: it can). The engine registry
# answers it; the manager only asks, so a refusal comes before any load.
Servability = Callable[[ModelKind], "str | None"]


class ManagerObserver(Protocol):
    """Told what the manager does, for metrics (``server/observe.py``); runs on the loop."""

    def requested(self, name: str) -> None:
        """A request asked for registered model ``name`` (aliases resolved)."""

    def loaded(self, name: str, seconds: float) -> None:
        """Model ``name`` finished loading in ``seconds``."""


@dataclass
class ManagerPolicy:
    budget_bytes: int
    idle_unload_seconds: float | None = None
    contention: str = "wait"
    wait_timeout_s: float = 60.0
    reaper_interval_s: float = 1.0


class ModelLease(Generic[E]):
    """Holds one model loaded and un-evictable while a request uses it.

    ``E`` is the engine protocol of the family it was leased for
    (``ModelLease[TextGenerator]``); an admin lease is ``ModelLease[ModelEngine]``.
    """

    def __init__(self, manager: ModelManager, residency: ResidencyManager,
                 family: Family[E], touch: bool = True) -> None:
        self._manager = manager
        self.residency = residency
        self.family = family
        self._touch = touch  # release marks the model used (False: a listing's lease)
        self._released = False
        self._engine: E | None = None

    @property
    def engine(self) -> E:
        # The kind was checked against the family; the family checks the engine (once:
        # a leased model is never unloaded, so its engine stays the same).
        if self._engine is None:
            self._engine = self.family.narrow(self.residency.engine)
        return self._engine

    @property
    def name(self) -> str:
        return self.residency.name

    @property
    def entry(self) -> ModelEntry:
        return self.residency.entry

    async def release(self) -> None:
        if not self._released:
            self._released = True
            await self._manager._release(self.residency, self._touch)


@dataclass
class Registration:
    entry: ModelEntry
    kind: ModelKind
    estimate: int
    reserve: int = 0


class ModelManager:
    """Owns every registered model's residency and the shared memory budget."""

    def __init__(self, policy: ManagerPolicy, loader: Loader,
                 servable: Servability | None = None,
                 observer: ManagerObserver | None = None) -> None:
        self.policy = policy
        self._loader = loader
        self._servable = servable
        self._observer = observer
        self._models: dict[str, ResidencyManager] = {}
        self._aliases: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition(self._lock)
        self._device_lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = asyncio.Event()  # set when shutdown begins: load waiters give up
        self.evictions = 0
        # decoded media of requests in flight
        self.transient = TransientMemory(self._changed, self.policy, self.used_bytes,
                                         lambda: self._closing)
        self.threads = WorkerThreads()  # ended models' threads, for the next loads to reuse
        self.adapter_changes = asyncio.Lock()  # LoRA adapters added or removed at run time

    # -- registry -----------------------------------------------------------
    def register(self, reg: Registration) -> ResidencyManager:
        if reg.entry.name in self._models:
            raise Conflict(f"A model named '{reg.entry.name}' is already registered.")
        self.check_names(reg.entry)
        res = ResidencyManager(reg.entry, reg.kind, reg.estimate, self._loader,
                               reserve=reg.reserve, on_change=self._notify,
                               load_gate=self._device_lock,
                               on_loaded=self._observer.loaded if self._observer else None,
                               threads=self.threads,
                               budget=lambda: self.budget_beside(reg.entry.name))
        self._models[reg.entry.name] = res
        for alias in reg.entry.aliases:
            self.alias(alias, reg.entry.name)
        return res

    def alias(self, alias: str, name: str) -> None:
        """Let ``alias`` (an exact name or a glob pattern such as ``claude-*``) reach
        registered model ``name``; 409 when it already reaches another model."""
        self._check_alias_free(alias, name)
        self._aliases[alias] = name

    def unalias(self, alias: str) -> None:
        """Let ``alias`` reach nothing any more (a removed LoRA adapter's name)."""
        self._aliases.pop(alias, None)

    def hold_adapter(self, model: str, res: ResidencyManager) -> str | None:
        """The LoRA adapter a request for ``model`` runs with on ``res`` (None: the base
        model), counted as in use until ``res.release_adapter``. A name that stopped reaching
        ``res`` while the request waited for it (an adapter removed) is a 404."""
        try:
            owner = self.resolve_name(model)
        except ModelNotFound:
            owner = None
        if owner != res.name:
            raise ModelNotFound(model, self.names)
        if model not in res.entry.adapters:
            return None
        res.adapter_users[model] += 1
        return model

    def check_names(self, entry: ModelEntry) -> None:
        """409 unless ``entry``'s name and aliases are free of other models' names and
        aliases (the registry file's rule); call it before replacing a model."""
        owner = self._aliases.get(entry.name)
        if owner is not None and owner != entry.name and owner in self._models:
            raise Conflict(f"'{entry.name}' is an alias of model '{owner}'.",
                           code="alias_in_use")
        for alias in entry.aliases:
            if alias in self._models and alias != entry.name:
                raise Conflict(f"Alias '{alias}' is the name of a model.", code="alias_in_use")
            self._check_alias_free(alias, entry.name)

    def _check_alias_free(self, alias: str, name: str) -> None:
        owner = self._aliases.get(alias)
        if owner is not None and owner != name and owner in self._models:
            raise Conflict(f"Alias '{alias}' already belongs to model '{owner}'.",
                           code="alias_in_use")

    def aliases_of(self, name: str) -> list[str]:
        """The aliases and alias patterns that reach registered model ``name``."""
        return [a for a, n in self._aliases.items() if n == name]

    def _match_pattern(self, name: str) -> str | None:
        """The model of the most specific alias pattern matching ``name`` (ties: the
        pattern registered first, i.e. file order), or None."""
        best: tuple[int, str] | None = None
        for pattern, target in self._aliases.items():
            if is_alias_pattern(pattern) and fnmatch.fnmatchcase(name, pattern):
                score = alias_specificity(pattern)
                if best is None or score > best[0]:
                    best = (score, target)
        return best[1] if best else None

    async def unregister(self, name: str) -> None:
        """Remove a model (DELETE, or the first half of a replace); refused while in use.

        It is marked retired synchronously, so no request can lease it from
        here on (a waiting one resolves the name again), and it stays in the
        table, counted in the budget, until its engine is closed: nothing is
        left loaded outside the table.
        """
        res = self.get(name)
        if res.leases:
            raise Conflict(f"Model '{name}' is in use by {res.leases} request(s); retry later.")
        res.retired = True
        try:
            await res.retire()
        finally:
            if self._models.get(res.name) is res:
                del self._models[res.name]
            self._aliases = {a: n for a, n in self._aliases.items() if n != res.name}
            await self._notify()

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def residencies(self) -> list[ResidencyManager]:
        return list(self._models.values())

    def resolve_name(self, name: str) -> str:
        if name in self._models:
            return name
        if name in self._aliases:
            return self._aliases[name]
        matched = self._match_pattern(name)
        if matched is not None:
            return matched
        raise ModelNotFound(name, self.names)

    def get(self, name: str) -> ResidencyManager:
        return self._models[self.resolve_name(name)]

    # -- budget -------------------------------------------------------------
    def used_bytes(self, exclude: ResidencyManager | None = None) -> int:
        return sum(r.accounted_bytes() for r in self._models.values() if r is not exclude)

    def budget_beside(self, name: str) -> tuple[int, int]:
        """(the budget, bytes every other model holds): what an engine may grow into is the
        difference less its own weights. Read from model worker threads, so it iterates a
        snapshot of the table and tolerates a model changing state meanwhile."""
        others = self.transient.held  # decoded media of requests in flight
        for res in list(self._models.values()):
            if res.name != name:
                others += res.accounted_bytes()
        return self.policy.budget_bytes, others

    def _holders(self) -> str:
        held = [f"{r.name} ({format_bytes(r.accounted_bytes())}, {r.state}"
                f"{', in use' if r.leases else ''}{', pinned' if r.pinned else ''})"
                for r in self._models.values() if r.accounted_bytes()]
        return ", ".join(held) or "nothing"

    def _victim(self, exclude: ResidencyManager) -> ResidencyManager | None:
        candidates = [r for r in self._models.values()
                      if r is not exclude and r.state == State.LOADED and not r.leases
                      and not r.pinned and not r.draining]
        if not candidates:
            return None
        return min(candidates, key=lambda r: r.last_used or r.loaded_at or 0.0)

    # -- leases ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, name: str, family: Family[E],
                    endpoint: str = "") -> AsyncIterator[ModelLease[E]]:
        """Hold ``name`` loaded for the duration of the ``async with`` block."""
        lease = await self.acquire(name, family, endpoint)
        try:
            yield lease
        finally:
            await lease.release()

    def check_kind(self, name: str, family: Family[Any] | None, endpoint: str = "") -> None:
        """Refuse, before anything is loaded (400), a model of a kind the endpoint does not
        serve (``family``; None: any kind), or one this install cannot serve."""
        res = self.get(name)
        if family is not None and res.kind not in family.kinds:
            where = f" {endpoint}" if endpoint else " this endpoint"
            raise InvalidRequest(
                f"Model '{res.name}' is a {res.kind} model;{where} serves "
                f"{' / '.join(sorted(str(k) for k in family.kinds))} models.",
                param="model", code="wrong_model_kind")
        refusal = self.unservable(res.kind)
        if refusal is not None:
            raise InvalidRequest(f"Model '{res.name}' is of kind {res.kind}, which this server "
                                 f"cannot serve: {refusal}", param="model",
                                 code="model_kind_unavailable")

    def unservable(self, kind: ModelKind) -> str | None:
        """Why this install cannot serve ``kind`` models (None: it can)."""
        return self._servable(kind) if self._servable is not None else None

    @overload
    async def acquire(self, name: str) -> ModelLease[ModelEngine]: ...

    @overload
    async def acquire(self, name: str, family: Family[E], endpoint: str = "") -> ModelLease[E]: ...

    async def acquire(self, name: str, family: Family[Any] | None = None,
                      endpoint: str = "") -> ModelLease[Any]:
        """Lease ``name`` for ``family`` (None: any kind, for admin loads), loading it if
        needed; every refusal that needs no load comes first."""
        family = family if family is not None else ANY_FAMILY
        self.check_kind(name, family, endpoint)
        if self._observer is not None:
            self._observer.requested(self.get(name).name)
        deadline = time.monotonic() + self.policy.wait_timeout_s
        while True:
            if self._closing:
                raise Overloaded("The server is shutting down.", retry_after=5)
            async with self._lock:
                # Resolved under the lock: a model removed while this request
                # waited for the lock is never leased (nor loaded) again. Nor
                # is one being drained: a lease taken now would hold the drain
                # up until this request gave up waiting for it.
                self.check_kind(name, family, endpoint)
                res = self.get(name)
                if not res.retired and not res.draining:
                    res.leases += 1
                    break
            await self._wait_change(deadline, res, "is being unloaded, removed or replaced")
        try:
            await self._ensure_loaded(res)
        except BaseException:
            await self._release(res)
            raise
        res.last_used = time.monotonic()
        return ModelLease(self, res, family)

    @contextlib.asynccontextmanager
    async def lease_if_loaded(self, name: str,
                              family: Family[E]) -> AsyncIterator[ModelLease[E] | None]:
        """A lease on ``name`` while the block runs if it is loaded now as a model of
        ``family``, else None: what a listing reads a loaded model's facts through, never
        loading one nor keeping it from being idle (its ``last_used`` stays as it was)."""
        async with self._lock:
            res = self.get(name)
            loaded = (res.kind in family.kinds and res.state == State.LOADED
                      and not res.retired and not res.draining)
            if loaded:
                res.leases += 1
        if not loaded:
            yield None
            return
        lease = ModelLease(self, res, family, touch=False)
        try:
            yield lease
        finally:
            await lease.release()

    async def _release(self, res: ResidencyManager, touch: bool = True) -> None:
        async with self._lock:
            res.leases = max(0, res.leases - 1)
            if touch:
                res.last_used = time.monotonic()
            self._changed.notify_all()

    async def _notify(self) -> None:
        async with self._lock:
            self._changed.notify_all()

    async def _ensure_loaded(self, res: ResidencyManager) -> None:
        deadline = time.monotonic() + self.policy.wait_timeout_s
        while True:
            if self._closing:
                raise Overloaded("The server is shutting down.", retry_after=5)
            if res.draining or res.state == State.UNLOADING:
                await self._wait_change(deadline, res, "is being unloaded")
                continue
            if res.state == State.LOADED:
                if res.worker_dead():
                    raise Overloaded(
                        f"Model '{res.name}' is broken: {res.health()}. Unload it "
                        "(POST /v1/models/unload) and the next request loads it again.",
                        retry_after=5, code="model_unhealthy")
                return
            if res.state == State.LOADING:
                await self._until_closing(res.wait_loaded())
                continue
            async with self._lock:
                if res.state in (State.LOADED, State.LOADING) or res.draining:
                    continue
                if not await self._make_room(res, deadline):
                    continue
                task = res.start_load()
            await self._until_closing(asyncio.shield(task))
            return

    async def _until_closing(self, wait: Awaitable[Any]) -> None:
        """Await a load, unless shutdown begins first (then 503; the load is shutdown's)."""
        waiter = asyncio.ensure_future(wait)
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            done, _ = await asyncio.wait((waiter, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not waiter.done():
                waiter.cancel()
        if waiter not in done:
            raise Overloaded("The server is shutting down.", retry_after=5)
        waiter.result()

    async def _wait_change(self, deadline: float, res: ResidencyManager, why: str) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Overloaded(f"Model '{res.name}' {why}; retry shortly.", retry_after=2)
        async with self._lock:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    async def _make_room(self, res: ResidencyManager, deadline: float) -> bool:
        """Called with the lock held. Evicts until ``res`` fits; False: state changed, retry."""
        budget = self.policy.budget_bytes
        need = res.estimate
        if need > budget:
            raise InsufficientStorage(
                f"Model '{res.name}' needs an estimated {format_bytes(need)}, more than the whole "
                f"memory budget of {format_bytes(budget)}. Raise --memory-budget or use a smaller "
                "or quantized model.", param="model", code="model_too_large")
        while self.used_bytes(exclude=res) + need > budget:
            victim = self._victim(res)
            if victim is not None:
                log.info("evicting %s (%s) to load %s", victim.name,
                         format_bytes(victim.accounted_bytes()), res.name)
                self.evictions += 1
                self._lock.release()
                try:
                    await victim.unload()
                finally:
                    await self._lock.acquire()
                return False
            message = (f"Memory budget {format_bytes(budget)} is held by {self._holders()}; "
                       f"model '{res.name}' needs {format_bytes(need)} and nothing can be evicted.")
            if self.policy.contention == "fail":
                raise Overloaded(message, retry_after=5, code="memory_budget_full")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Overloaded(message + f" Waited {self.policy.wait_timeout_s:.0f}s.",
                                 retry_after=5, code="memory_budget_full")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass
            if res.state in (State.LOADED, State.LOADING) or self._closing:
                return False
        return True

    # -- admin ----------------------------------------------------------------
    async def load(self, name: str) -> ResidencyManager:
        lease = await self.acquire(name)
        await lease.release()
        return lease.residency

    async def unload(self, name: str, wait: bool = True, timeout: float = 300.0) -> bool:
        """Unload ``name``; with ``wait`` new requests queue until in-flight ones finish."""
        res = self.get(name)
        if res.state != State.LOADED:
            return False
        if res.leases and not wait:
            raise Conflict(f"Model '{res.name}' is in use by {res.leases} request(s); "
                           "retry later or unload with wait=true.", code="model_in_use")
        res.draining = True
        try:
            deadline = time.monotonic() + timeout
            async with self._lock:
                while res.leases:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Conflict(f"Model '{res.name}' stayed in use for {timeout:.0f}s.")
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                    except asyncio.TimeoutError:
                        pass
            await res.unload()
        finally:
            res.draining = False
            await self._notify()
        return True

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def preload(self, names: Iterable[str]) -> None:
        for name in names:
            await self.load(name)

    def idle_ttl(self, res: ResidencyManager) -> float | None:
        """Idle seconds before ``res`` unloads: a client's ``keep_alive``, else the entry's
        ``ttl_seconds``, else the server's default (None: never; pinned models never)."""
        if res.pinned:
            return None
        for ttl in (res.keep_alive, res.entry.ttl_seconds, self.policy.idle_unload_seconds):
            if ttl is not None:
                return ttl
        return None

    async def _reap(self) -> None:
        """Unload models idle past their TTL (per model, or the manager default)."""
        while not self._closing:
            await asyncio.sleep(self.policy.reaper_interval_s)
            now = time.monotonic()
            for res in list(self._models.values()):
                ttl = self.idle_ttl(res)
                if ttl is None or res.pinned or res.state != State.LOADED or res.leases:
                    continue
                if res.idle_for(now) >= ttl:
                    log.info("unloading %s: idle for %.0fs (ttl %.0fs)", res.name,
                             res.idle_for(now), ttl)
                    try:
                        await res.unload()
                    except Exception:
                        log.exception("idle unload of %s failed", res.name)

    def begin_shutdown(self) -> None:
        """Refuse new work from now on (503); requests waiting for a load stop waiting.

        Called as the server starts its graceful shutdown, before it waits for
        in-flight requests, so none of them waits for a load that shutdown
        will abandon. Leases already held keep their engine until released.
        """
        self._closing = True
        self._closed.set()

    async def shutdown(self, timeout: float = 8.0) -> None:
        """Save state and close every engine, even mid-load or mid-unload; bounded by ``timeout``."""
        self.begin_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        await asyncio.gather(*(r.shutdown(timeout) for r in self._models.values()),
                             return_exceptions=True)
