"""The registry's read-modify-write is locked across processes: concurrent writers lose nothing."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest

from mlxd.models import registry as registry_module
from mlxd.models.registry import RegistryData, RegistryFile
from mlxd.models.spec import ModelEntry

PER_WRITER = 10


def _register_many(path: str, prefix: str, start: object) -> None:
    """One writer process: ``PER_WRITER`` upserts, as ``mlxd model register`` does them."""
    registry = RegistryFile(Path(path))
    start.wait()  # type: ignore[attr-defined]  # both imported and ready: a real overlap
    for i in range(PER_WRITER):
        registry.upsert(ModelEntry(name=f"{prefix}-{i}", source=f"org/{prefix}-{i}"))


def test_two_processes_registering_at_once_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    ctx = mp.get_context("spawn")  # a fresh interpreter each, like two `mlxd` commands
    start = ctx.Barrier(2)
    writers = [ctx.Process(target=_register_many, args=(str(path), p, start)) for p in "ab"]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    names = {m.name for m in RegistryFile(path).load().models}
    assert names == {f"{p}-{i}" for p in "ab" for i in range(PER_WRITER)}


def test_the_portable_fallback_lock_also_serializes_writers(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Where fcntl is missing: two RegistryFile objects (no shared thread lock) in threads."""
    monkeypatch.setattr(registry_module, "fcntl", None)
    path = tmp_path / "models.yaml"
    inside, release = threading.Event(), threading.Event()
    first = RegistryFile(path)
    original_load = first.load

    def slow_load() -> RegistryData:  # hold the lock mid read-modify-write until told to go on
        data = original_load()
        inside.set()
        release.wait(30)
        return data

    first.load = slow_load  # type: ignore[method-assign]
    t = threading.Thread(target=first.upsert, args=(ModelEntry(name="a", source="org/a"),))
    t.start()
    assert inside.wait(30)
    second = threading.Thread(target=RegistryFile(path).upsert,
                              args=(ModelEntry(name="b", source="org/b"),))
    second.start()
    second.join(3)  # without the lock it finishes now, and the first writer then drops 'b'
    assert second.is_alive()  # waits for the first writer's lock
    release.set()
    t.join(30)
    second.join(30)
    assert {m.name for m in RegistryFile(path).load().models} == {"a", "b"}
    assert not list(tmp_path.glob("*.excl"))  # the lock file is gone afterwards
