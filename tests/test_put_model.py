"""``PUT /v1/models`` does its blocking work (detection, hashing, the fsynced registry write)
in a worker thread: the event loop keeps answering meanwhile."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import ServerConfig
from mlxd.server.routes import models as models_routes
from tests.helpers.server import RunningServer, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, test_home: Path
           ) -> Iterator[RunningServer]:
    registry = tmp_path_factory.mktemp("put") / "models.yaml"
    registry.write_text("models: []\n")
    cfg = ServerConfig(models_config=registry, home=test_home, no_starter=True,
                       allow_no_models=True)  # models come by PUT
    with running_server(cfg) as srv:
        yield srv


def _blocking(real: Callable[..., Any], entered: threading.Event,
              release: threading.Event) -> Callable[..., Any]:
    """``real``, held until the test says go (a slow disk, made deterministic)."""
    def held(*args: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(60)
        return real(*args, **kw)
    return held


@pytest.mark.parametrize("step", ["detection", "registry write"])
def test_the_loop_answers_while_a_put_is_blocked(server: RunningServer, tiny_model: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 step: str) -> None:
    entered, release = threading.Event(), threading.Event()
    if step == "detection":
        monkeypatch.setattr(models_routes, "registration_for",
                            _blocking(models_routes.registration_for, entered, release))
    else:
        registry = server.ctx.registry
        monkeypatch.setattr(registry, "upsert", _blocking(registry.upsert, entered, release))
    name = f"put-{step.split()[0]}"
    with server.client() as http, cf.ThreadPoolExecutor(1) as pool:
        try:
            put = pool.submit(http.put, "/v1/models", json={"name": name,
                                                            "source": str(tiny_model)})
            assert entered.wait(60)
            health = http.get("/health", timeout=30)  # would time out on a blocked loop
            assert health.status_code == 200
            listed = http.get("/v1/models", timeout=30)
            assert listed.status_code == 200
        finally:
            release.set()
        r = put.result(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["persisted"] is True and name in server.ctx.manager.names
