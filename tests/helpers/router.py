"""mlxd replicas behind LiteLLM's Router, all on 127.0.0.1.

Each replica is a real ``mlxd serve`` process (so SIGTERM drains it as in
production); the Router is LiteLLM's, in this process. LiteLLM fetches a
model price list from the internet at import unless told not to, so the
environment says so first, and ``loopback_only`` refuses any other address
while a test runs (a bug must not reach the network either).
"""

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
import pytest

from tests.helpers.server import free_port, wait_serving

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
START_TIMEOUT_S = 180.0


class NetworkRefused(OSError):
    """A connection to somewhere other than 127.0.0.1 was attempted."""


@contextmanager
def loopback_only() -> Iterator[None]:
    """Refuse name lookups and connections to anything but the loopback address."""
    mp = pytest.MonkeyPatch()
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in LOOPBACK:
            raise NetworkRefused(f"tests talk only to 127.0.0.1, not {host}")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and name not in LOOPBACK:
            raise NetworkRefused(f"tests resolve only 127.0.0.1, not {name}")
        return real_getaddrinfo(host, *args, **kwargs)

    mp.setattr(socket.socket, "connect", connect)
    mp.setattr(socket.socket, "connect_ex", connect_ex)
    mp.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        yield
    finally:
        mp.undo()


def import_litellm() -> Any:
    """LiteLLM, told to use its bundled price list instead of downloading one."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    with loopback_only():
        import litellm
    litellm.telemetry = False
    return litellm


class Replica:
    """One ``mlxd serve`` process."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/health", timeout=10).json())

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def start_replica(model: Path, home: Path, log: Path, *extra: str) -> Replica:
    port = free_port()
    cmd = [sys.executable, "-m", "mlxd", "serve", str(model), "--served-model-name", "tiny",
           "--no-starter", "--port", str(port), "--max-tokens", "64", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=dict(os.environ, MLXD_HOME=str(home),
                                              HF_HUB_OFFLINE="1"),
                                stdout=out, stderr=subprocess.STDOUT)
    return Replica(proc, port, log)


def wait_ready(replica: Replica) -> None:
    wait_serving(replica.proc, replica.url, replica.log, START_TIMEOUT_S,
                 ready=lambda health: bool(health.get("ready")))


def make_router(replicas: list[Replica], **kwargs: Any) -> Any:
    """LiteLLM's Router over ``replicas``: least-busy routing, session affinity, and
    retries that move off a replica answering 503 (draining) or gone."""
    litellm = import_litellm()
    model_list = [{"model_name": "tiny",
                   "litellm_params": {"model": "openai/tiny", "api_base": r.url + "/v1",
                                      "api_key": "unused"}} for r in replicas]
    return litellm.Router(model_list=model_list, routing_strategy="least-busy",
                          optional_pre_call_checks=["session_affinity"], num_retries=4,
                          retry_after=0, allowed_fails=0, cooldown_time=60, **kwargs)


def served_by(response: Any) -> str:
    """The replica URL that answered (LiteLLM records the deployment's api_base)."""
    return str(response._hidden_params["api_base"]).removesuffix("/v1")
