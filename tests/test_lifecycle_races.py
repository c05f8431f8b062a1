"""Model lifecycle under races and faults (issue 16, items 3, 11-14).

Races are driven explicitly: a real ``ModelManager`` with the real engine
factory on a tiny model, steered by asyncio task order and a gate
(``threading.Event``) around the real loader; never by sleeps. Faults that
cannot be caused for real (a scheduler step that fails for the whole batch,
a worker thread that dies) are injected into the real engine's scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.config import ServerConfig
from mlxd.engines.base import CHAT, EMBEDDING
from mlxd.engines.factory import build_loader
from mlxd.engines.text.prefix_cache import model_identity
from mlxd.errors import ModelNotFound, Overloaded
from mlxd.models.catalog import registration_for
from mlxd.models.manager import ManagerPolicy, ModelManager
from mlxd.models.residency import State
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.runtime.worker import FAILING_AFTER
from tests.helpers.server import RunningServer, running_server

BUDGET = 1 << 30
LONG_PROMPT = "The cache should hold this prompt. " * 30


class GatedLoader:
    """The real loader (resolve the source, then build the engine), with gates a test
    can close to hold a load mid-way: ``resolve_gate`` while the source resolves (a slow
    download), ``gate`` before the engine is built."""

    def __init__(self, config: ServerConfig) -> None:
        self.loader = build_loader(config, BUDGET)
        self.gate = threading.Event()
        self.gate.set()
        self.resolve_gate = threading.Event()
        self.resolve_gate.set()
        self.resolving = threading.Event()
        self.started = threading.Event()
        self.engines: list[Any] = []

    def resolve(self, entry: ModelEntry) -> Path:
        self.resolving.set()
        assert self.resolve_gate.wait(120), "the test never opened the resolve gate"
        return self.loader.resolve(entry)

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: Any) -> Any:
        self.started.set()
        assert self.gate.wait(120), "the test never opened the load gate"
        engine = self.loader.build(entry, kind, path, worker)
        self.engines.append(engine)
        return engine


def is_closed(engine: Any) -> bool:
    return engine.model is None and engine.scheduler is None


def run_with_manager(tiny_model: Path, home: Path,
                     scenario: Callable[[ModelManager, GatedLoader], Awaitable[None]]) -> None:
    """Run ``scenario`` against a fresh manager serving ``tiny_model`` as ``a``."""
    config = ServerConfig(home=home, no_starter=True)
    loader = GatedLoader(config)

    async def main() -> None:
        manager = ModelManager(ManagerPolicy(budget_bytes=BUDGET, wait_timeout_s=60), loader)
        entry = ModelEntry(name="a", source=str(tiny_model))
        manager.register(registration_for(entry, config, BUDGET))
        try:
            await scenario(manager, loader)
        finally:
            loader.gate.set()
            await manager.shutdown()

    asyncio.run(main())


async def wait_for_thread_event(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 120)


# -- item 14: idle/eviction unload vs a request queued on the event loop -------------


def test_a_request_queued_behind_an_unload_waits_and_gets_a_fresh_engine(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = await manager.load("a")
        first = res.engine
        # The reaper (or an eviction) starts an unload and, in the same turn of
        # the loop, a request asks for the model: the request runs before the
        # unload task's first step.
        unload = asyncio.create_task(res.unload())
        acquire = asyncio.create_task(manager.acquire("a"))
        lease = await acquire
        await unload
        assert is_closed(first)
        assert lease.engine is not None and lease.engine is not first
        assert not is_closed(lease.engine)
        assert res.state == State.LOADED and res.loads == 2
        await lease.release()

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_an_unload_queued_behind_a_new_lease_is_refused(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = await manager.load("a")
        engine = res.engine
        acquire = asyncio.create_task(manager.acquire("a"))
        unload = asyncio.create_task(res.unload())  # the idle check ran before the lease
        lease = await acquire
        unloaded = await unload
        assert res.state == State.LOADED and lease.engine is engine
        assert not is_closed(engine)
        assert unloaded is False
        await lease.release()

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_a_request_arriving_during_a_drain_does_not_hold_the_drain_up(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = await manager.load("a")
        first = res.engine
        in_flight = await manager.acquire("a")
        unload = asyncio.create_task(manager.unload("a"))  # POST /v1/models/unload, wait=true
        await asyncio.sleep(0)
        assert res.draining  # waits for the request in flight
        newcomer = asyncio.create_task(manager.acquire("a"))
        await asyncio.sleep(0)
        await in_flight.release()
        # Generous bounds: the newcomer must not hold the drain up until it gives up (60 s).
        assert await asyncio.wait_for(unload, 30) is True
        lease = await asyncio.wait_for(newcomer, 30)
        assert is_closed(first)
        assert lease.engine is not first and not is_closed(lease.engine)
        await lease.release()

    run_with_manager(tiny_model, tmp_path / "home", scenario)


# -- item 12: deleting / replacing a model while a request waits for it ------------------


def test_delete_while_a_request_waits_for_the_lock_leaves_no_orphan(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        async with manager._lock:  # another request holds the manager lock for a moment
            acquire = asyncio.create_task(manager.acquire("a"))
            await asyncio.sleep(0)  # the request now waits for the lock
            unregister = asyncio.create_task(manager.unregister("a"))
            await asyncio.sleep(0)  # DELETE /v1/models/a runs up to its first wait
        await unregister
        with pytest.raises(ModelNotFound):
            await acquire
        assert "a" not in manager.names
        assert res.state != State.LOADED and not loader.engines

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_delete_during_a_load_whose_client_left_closes_the_engine(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        loader.gate.clear()
        acquire = asyncio.create_task(manager.acquire("a"))
        await wait_for_thread_event(loader.started)
        acquire.cancel()  # the client gave up; the load goes on without a lease
        with contextlib.suppress(asyncio.CancelledError):
            await acquire
        assert res.state == State.LOADING and res.leases == 0
        unregister = asyncio.create_task(manager.unregister("a"))
        await asyncio.sleep(0)
        loader.gate.set()
        await unregister
        with contextlib.suppress(Exception):
            await res.wait_loaded()  # let the load's own continuation run
        assert "a" not in manager.names
        assert res.state != State.LOADED
        assert len(loader.engines) == 1 and is_closed(loader.engines[0])

    run_with_manager(tiny_model, tmp_path / "home", scenario)


# -- item 13: shutdown during a load ----------------------------------------------


def test_shutdown_abandoning_a_slow_load_closes_the_engine_and_refuses_the_lease(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        loader.gate.clear()
        acquire = asyncio.create_task(manager.acquire("a"))
        await wait_for_thread_event(loader.started)
        await manager.shutdown(timeout=0.2)  # the load outlasts the shutdown's patience
        with pytest.raises(Overloaded):
            await acquire  # the waiting request gets a 503, not a lease
        loader.gate.set()
        with contextlib.suppress(Exception):
            await res.wait_loaded()  # the load ends (and closes what it built)
        assert res.state != State.LOADED and res.loaded is None
        assert len(loader.engines) == 1 and is_closed(loader.engines[0])

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_shutdown_during_a_slow_source_resolve_never_builds_the_engine(
        tiny_model: Path, tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        loader.resolve_gate.clear()  # the download / conversion is still running
        acquire = asyncio.create_task(manager.acquire("a"))
        await wait_for_thread_event(loader.resolving)
        await manager.shutdown(timeout=0.2)
        with pytest.raises(Overloaded):
            await acquire
        loader.resolve_gate.set()
        with contextlib.suppress(Exception):
            await res.wait_loaded()  # the resolve ends; the abandoned load stops there
        assert res.state != State.LOADED and res.loaded is None
        assert not loader.started.is_set() and loader.engines == []

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_a_load_finishing_during_shutdown_is_closed_not_leased(tiny_model: Path,
                                                               tmp_path: Path) -> None:
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        loader.gate.clear()
        acquire = asyncio.create_task(manager.acquire("a"))
        await wait_for_thread_event(loader.started)
        shutdown = asyncio.create_task(manager.shutdown(timeout=60))
        await asyncio.sleep(0)  # shutdown has begun and waits for the load
        loader.gate.set()
        await shutdown
        with pytest.raises(Overloaded):
            await acquire
        assert res.state != State.LOADED
        assert len(loader.engines) == 1 and is_closed(loader.engines[0])

    run_with_manager(tiny_model, tmp_path / "home", scenario)


def test_shutdown_saves_the_prefix_cache(tiny_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    cfg = ServerConfig(model=str(tiny_model), served_model_name="a", home=home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        r = http.post("/v1/completions", json={"model": "a", "prompt": LONG_PROMPT,
                                               "max_tokens": 2})
        assert r.status_code == 200, r.text
    folder = home / "prefix-cache" / "a"
    assert list(folder.glob("*.safetensors"))
    index = json.loads((folder / "index.json").read_text())
    assert index["model_identity"] == model_identity(tiny_model)
    assert not list(folder.parent.glob("*.tmp")) and not list(folder.parent.glob("*.old"))


# -- item 11: a saved prefix cache belongs to the model that wrote it ---------------------


@pytest.fixture(scope="module")
def tiny_model_twin(session_dir: Path, tiny_model: Path) -> Path:
    """Same architecture and tokenizer as ``tiny_model``, other weights."""
    from tests.helpers.tiny_models import build_llama

    return build_llama(session_dir / "tiny-llama-twin", hidden=64, layers=2, heads=4, seed=7,
                       tokenizer_from=tiny_model)


def _prefix_entries(srv: RunningServer, http: httpx.Client, name: str) -> int:
    assert http.post("/v1/models/load", json={"model": name}).status_code == 200
    return len(srv.ctx.manager.get(name).engine.prefix_cache)


def test_a_prefix_cache_is_restored_only_into_the_model_that_saved_it(
        tiny_model: Path, tiny_model_twin: Path, tmp_path: Path) -> None:
    cfg = ServerConfig(model=str(tiny_model), served_model_name="x", home=tmp_path / "home",
                       no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        r = http.post("/v1/completions", json={"model": "x", "prompt": LONG_PROMPT,
                                               "max_tokens": 2})
        assert r.status_code == 200, r.text
        # Re-point the name at other weights: A's cache is saved on the way out...
        r = http.put("/v1/models", json={"name": "x", "source": str(tiny_model_twin)})
        assert r.status_code == 200, r.text
        assert list((tmp_path / "home" / "prefix-cache" / "x").glob("*.safetensors"))
        # ...and not restored into B,
        assert _prefix_entries(srv, http, "x") == 0
        # while A, pointed at again, gets it back.
        r = http.put("/v1/models", json={"name": "x", "source": str(tiny_model)})
        assert r.status_code == 200, r.text
        assert _prefix_entries(srv, http, "x") > 0


def test_model_identity_changes_when_the_weights_are_rewritten(tiny_model: Path,
                                                               tiny_model_twin: Path,
                                                               tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    before = model_identity(copy)
    assert model_identity(copy) == before
    assert model_identity(tiny_model) != before  # another path is another model
    shutil.copy(tiny_model_twin / "model.safetensors", copy / "model.safetensors")  # re-convert
    assert model_identity(copy) != before


# -- item 3: a broken model shows in /health and /v1/models ------------------------------


class WorkerKilled(BaseException):
    """Stands in for a fault that ends the worker thread (not an ``Exception``)."""


@pytest.fixture
def health_server(tiny_model: Path, tmp_path: Path) -> Iterator[RunningServer]:
    cfg = ServerConfig(model=str(tiny_model), served_model_name="t", home=tmp_path / "home",
                       no_starter=True, enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


def _ask(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "t", "prompt": "hello", "max_tokens": 2},
                     timeout=60)


def _card(http: httpx.Client) -> dict[str, Any]:
    return dict(http.get("/v1/models/t").json())


def test_repeated_whole_batch_failures_show_in_health_and_models(
        health_server: RunningServer) -> None:
    with health_server.client() as http:
        assert _ask(http).status_code == 200
        scheduler = health_server.ctx.manager.get("t").engine.scheduler

        def broken_step() -> None:
            raise RuntimeError("injected batch fault")

        scheduler._step = broken_step
        for _ in range(FAILING_AFTER):
            assert _ask(http).status_code != 200
        health = http.get("/health").json()
        assert health["status"] == "degraded"
        assert "injected batch fault" in health["unhealthy"]["t"]
        card = _card(http)
        assert card["health"] == "failing" and "injected batch fault" in card["error"]
        del scheduler._step  # the fault clears: one good step makes it healthy again
        assert _ask(http).status_code == 200
        assert http.get("/health").json()["status"] == "ok"
        assert _card(http)["health"] == "ok"


def test_a_dead_worker_thread_shows_fails_fast_and_recovers_on_unload(
        health_server: RunningServer) -> None:
    with health_server.client() as http:
        assert _ask(http).status_code == 200
        scheduler = health_server.ctx.manager.get("t").engine.scheduler

        def fatal_step() -> None:
            raise WorkerKilled("injected thread death")

        scheduler._step = fatal_step
        assert _ask(http).status_code != 200  # ended with an error, not left hanging
        health = http.get("/health").json()
        assert health["status"] == "degraded"
        assert "worker thread died" in health["unhealthy"]["t"]
        assert _card(http)["health"] == "failing"
        r = _ask(http)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unhealthy"
        assert http.post("/v1/models/unload", json={"model": "t"}).status_code == 200
        assert _ask(http).status_code == 200  # reloaded with a new worker
        assert http.get("/health").json() == {**health, "status": "ok", "unhealthy": {},
                                              "ready": True}


def test_an_encoder_whose_every_batch_fails_is_reported_broken() -> None:
    """Embedding/rerank batchers fail a batch's requests themselves; that counts too."""
    import numpy as np

    from mlxd.engines.encoders.token_batcher import Encoded, TokenBatcher
    from mlxd.runtime.worker import ModelWorker

    failing = threading.Event()
    failing.set()

    def forward(rows: Any) -> Any:
        if failing.is_set():
            raise RuntimeError("injected encoder fault")
        return np.zeros((len(rows), 2), dtype=np.float32)

    worker = ModelWorker("encoder")
    batcher = TokenBatcher(forward, wake=worker.wake)
    worker.set_stepper(batcher)
    worker.start()
    try:
        for _ in range(FAILING_AFTER):
            with pytest.raises(RuntimeError):
                batcher.submit([Encoded([1, 2, 3])]).reply.result(60)
        worker.submit(lambda: None).result(60)  # the step that failed has been counted
        assert "injected encoder fault" in (worker.fault() or "")
        failing.clear()
        assert batcher.submit([Encoded([1, 2])]).reply.result(60).shape == (1, 2)
        worker.submit(lambda: None).result(60)
        assert worker.fault() is None
    finally:
        worker.stop()


# -- issue 31, item 5: an unload whose worker does not stop --------------------------


def test_unload_while_the_worker_still_runs_fails_and_keeps_the_engine_counted(
        tiny_model: Path, tmp_path: Path) -> None:
    """A job that cannot be cancelled holds the worker past the unload's close timeout:
    the unload answers 503 instead of success, and the old engine's bytes stay in the
    budget (next to a reloaded copy) until its thread has really ended."""
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = await manager.load("a")
        one = manager.used_bytes()
        old_worker = res.loaded.worker  # type: ignore[union-attr]
        busy = threading.Event()
        release = threading.Event()

        def stuck() -> None:  # a job that never checks a cancel token
            busy.set()
            release.wait(120)

        old_worker.submit(stuck)
        await wait_for_thread_event(busy)
        res.close_timeout, res.stop_timeout = 0.5, 0.5
        with pytest.raises(Overloaded) as refused:
            await manager.unload("a")
        assert refused.value.code == "unload_incomplete"
        assert res.state == State.UNLOADED and old_worker.alive
        assert manager.used_bytes() >= one  # still counted: it still holds its memory
        await manager.load("a")  # a second copy: both are counted
        assert manager.used_bytes() >= 2 * one - 1024
        release.set()
        assert await asyncio.to_thread(old_worker.stop, 30)
        assert one - 1024 <= manager.used_bytes() <= one + 1024  # the old one has ended

    run_with_manager(tiny_model, tmp_path / "home", scenario)


# -- a listing's lease (issue 28: voices and templates read through a lease) ----------


def test_a_listing_lease_never_loads_and_leaves_the_idle_clock_alone(
        tiny_model: Path, tmp_path: Path) -> None:
    """``lease_if_loaded``: None while the model is not loaded (and nothing loads), a real
    lease while it is (it holds off an unload), released without counting as use, and
    None for a family the model is not of."""
    async def scenario(manager: ModelManager, loader: GatedLoader) -> None:
        res = manager.get("a")
        async with manager.lease_if_loaded("a", CHAT) as lease:
            assert lease is None
        assert res.state == State.UNLOADED and res.loads == 0
        await manager.load("a")
        used = res.last_used
        async with manager.lease_if_loaded("a", CHAT) as lease:
            assert lease is not None and res.leases == 1
            assert lease.engine.facts().context_length
        assert res.leases == 0 and res.last_used == used
        async with manager.lease_if_loaded("a", EMBEDDING) as lease:
            assert lease is None

    run_with_manager(tiny_model, tmp_path / "home", scenario)
