"""Start each contender as a subprocess on a free 127.0.0.1 port, wait (with a deadline)
until it answers, read its memory, and always kill it (its whole process group) at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import yaml

if TYPE_CHECKING:
    from mlxd.models.spec import ModelEntry

SERVED_NAME = "smollm2"


class ServerStartError(RuntimeError):
    """A server exited or did not answer before its deadline (the message has its log tail)."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one contender and what model name its requests carry."""

    name: str
    argv: tuple[str, ...]
    model: str
    ready_path: str = "/v1/models"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mlxd_spec(folder: Path, port: int, home: Path, blas: str) -> ServerSpec:
    """mlxd with its defaults (continuous batching, prefix cache) on ``folder``."""
    return ServerSpec("mlxd", (
        sys.executable, "-m", "mlxd", "serve", str(folder), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", SERVED_NAME, "--no-starter",
        "--home", str(home), "--log-level", "warning", "--blas", blas,
        # no prefix cache kept across runs: a "cold" prompt of this run could otherwise be
        # one a previous run left in the home, and the peers keep nothing either
        "--no-prefix-cache-persist"), SERVED_NAME)


def mlx_lm_spec(folder: Path, port: int) -> ServerSpec:
    """mlx-lm's own server (same venv as mlxd); it calls its one model ``default_model``."""
    return ServerSpec("mlx_lm.server", (
        sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "WARNING"), "default_model", "/health")


def vllm_mlx_spec(exe: Path, folder: Path, port: int) -> ServerSpec:
    """vllm-mlx from its own venv, continuous batching on.

    Its requests time out after 300 s without output by default: four cold 5.7k-token
    prefills of the agent trace take longer than that on a 2-core CPU, so the limit is
    raised (the benchmark's own deadlines still apply).
    """
    return ServerSpec("vllm-mlx", (
        str(exe), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
        "--continuous-batching", "--served-model-name", SERVED_NAME, "--timeout", "7200"),
        SERVED_NAME, "/health")


def mlxd_audio_spec(port: int, home: Path, blas: str, registry: Path,
                    models: Sequence[ModelEntry]) -> ServerSpec:
    """``mlxd serve`` with only ``models`` (audio starters) in its registry, which it writes
    to ``registry``: no chat model is preloaded. Requests carry the first model's name."""
    registry.write_text(yaml.safe_dump({"models": [m.public() for m in models]}))
    return ServerSpec("mlxd", (
        sys.executable, "-m", "mlxd", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--home", str(home), "--models-config", str(registry), "--log-level", "warning",
        "--blas", blas), models[0].name, "/health")


@contextmanager
def mlxd_audio_server(tag: str, models: Sequence[ModelEntry], *, home: Path, out: Path,
                      blas: str, env: dict[str, str]
                      ) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    """A started ``mlxd serve`` with the audio ``models`` (registry ``<out>/<tag>-models.yaml``,
    log ``<out>/logs/<tag>-mlxd.log``) and an HTTP client on it (30-minute timeout)."""
    port = free_port()
    spec = mlxd_audio_spec(port, home, blas, out / f"{tag}-models.yaml", models)
    with ServerProcess(spec, port, env, out / "logs" / f"{tag}-mlxd.log") as server, \
            httpx.Client(base_url=server.url, timeout=1800, trust_env=False) as http:
        yield server, http


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants so far (/proc stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (``VmRSS`` in /proc)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out.extend(children)
        todo.extend(children)
    return out


class ServerProcess:
    """``with ServerProcess(spec, port, env, log) as srv:`` a started, answering server."""

    def __init__(self, spec: ServerSpec, port: int, env: dict[str, str], log_path: Path,
                 start_timeout: float = 300.0) -> None:
        self.spec = spec
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_in_s = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        start = time.monotonic()
        self.proc = subprocess.Popen(self.spec.argv, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        try:
            self._wait_ready(start + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - start
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerStartError(f"{self.spec.name} exited with {self.proc.returncode}:"
                                           f"\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.spec.ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise ServerStartError(f"{self.spec.name} did not answer within {self.start_timeout:.0f}"
                               f" s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group is ours alone
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # whatever the server itself started is in the group too
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def subprocess_env(mode: str) -> tuple[dict[str, str], str]:
    """The environment every contender gets, and a description of its BLAS."""
    from mlxd.blas import plan_blas

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    plan = plan_blas(mode, env)
    if plan.action == "error":
        raise SystemExit(f"error: {plan.reason}")
    if plan.action == "preload" and plan.library:
        env["LD_PRELOAD"] = " ".join([str(plan.library), *env.get("LD_PRELOAD", "").split()])
    if plan.library:
        return env, f"OpenBLAS preloaded ({plan.library})"
    return env, "reference BLAS of the mlx-cpu wheel (no OpenBLAS)"


def write_report(out: Path, tag: str, results: dict[str, Any],
                 markdown: Callable[[dict[str, Any]], str]) -> None:
    """Write a bench's results as ``<tag>.json`` and its table as ``<tag>.md``, and print it."""
    (out / f"{tag}.json").write_text(json.dumps(results, indent=2) + "\n")
    report = markdown(results)
    (out / f"{tag}.md").write_text(report)
    print(report)


def machine(blas: str, dists: tuple[str, ...]) -> dict[str, Any]:
    """CPU model, cores, Python, BLAS and the versions of ``dists`` (None when absent)."""
    import platform
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for dist in dists:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "blas": blas,
            "python": platform.python_version(), "versions": versions}
