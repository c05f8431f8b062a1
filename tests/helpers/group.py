"""A sharded mlxd group on 127.0.0.1: ``mlxd serve --hosts`` through ``mlx.launch``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.server import free_port, wait_serving

START_TIMEOUT_S = 300.0  # two ranks load on a shared 2-core machine


def free_port_run(n: int) -> int:
    """A port ``p`` with ``p .. p+n-1`` free now (the control port and the ring's)."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


class RunningGroup:
    """Rank 0's URL and the launcher process (its own process group)."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120.0), **kw)

    def group(self) -> dict[str, Any]:
        with self.client() as c:
            card = c.get("/v1/models").json()["data"][0]
        return dict(card["group"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextmanager
def running_group(model: Path, home: Path, log: Path, *, ranks: int = 2,
                  group_timeout: float = 3.0, extra: tuple[str, ...] = ()
                  ) -> Iterator[RunningGroup]:
    """Start ``ranks`` ranks of ``mlxd serve MODEL --hosts 127.0.0.1,...`` and wait until
    rank 0 answers /health with the model loaded."""
    port, group_port = free_port(), free_port_run(ranks + 1)
    cmd = [sys.executable, "-m", "mlxd", "serve", str(model), "--served-model-name", "tiny",
           "--no-starter", "--port", str(port), "--hosts", ",".join(["127.0.0.1"] * ranks),
           "--group-port", str(group_port), "--group-timeout", str(group_timeout), *extra]
    env = dict(os.environ, MLXD_HOME=str(home), HF_HUB_OFFLINE="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    group = RunningGroup(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait_ready(group)
        yield group
    finally:
        group.stop()


def _wait_ready(group: RunningGroup) -> None:
    wait_serving(group.proc, group.url, group.log, START_TIMEOUT_S,
                 ready=lambda health: bool(health["loaded"]))
