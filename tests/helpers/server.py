"""A real mlxd server on 127.0.0.1 in a background thread, for tests."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from mlxd.config import ServerConfig
from mlxd.server.app import build_app
from mlxd.server.connections import guarded_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(proc: subprocess.Popen[Any], url: str, log: Path, timeout: float,
                 ready: Callable[[dict[str, Any]], bool] = lambda health: True) -> None:
    """Poll ``url``/health until a 200 whose JSON satisfies ``ready``; raise with the tail of
    ``log`` if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlxd serve exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200 and ready(r.json()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)  # polling a starting process, not synchronising with it
    raise TimeoutError(f"mlxd serve did not start: {log.read_text(errors='replace')[-3000:]}")


class RunningServer:
    def __init__(self, app: Any, port: int, config: ServerConfig | None = None) -> None:
        self.app = app
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # the same guarded uvicorn server as `mlxd serve` (timeouts, connection cap)
        cfg = (config or ServerConfig()).model_copy(update={"port": port, "host": "127.0.0.1"})
        self.server: uvicorn.Server = guarded_server(app, cfg, log_level="warning",
                                                     lifespan="on", timeout_graceful_shutdown=5)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def ctx(self) -> Any:
        return self.app.state.ctx

    def start(self, timeout: float = 120.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120.0), **kw)


@contextmanager
def running_server(config: ServerConfig | None = None, **kw: Any) -> Iterator[RunningServer]:
    port = free_port()
    cfg = config or ServerConfig()
    cfg = cfg.model_copy(update={"port": port, "host": "127.0.0.1"})
    app = build_app(cfg, **kw)
    srv = RunningServer(app, port, cfg)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
