"""Slow-client (slowloris) benchmark: many connections that send partial headers.

Starts ``mlxd serve`` (starter models, ``--no-preload``) as a subprocess whose soft open-file
limit is ``--nofile`` (1024 by default: the usual Linux default), opens ``--connections``
sockets that each send a request line and then one more header line every few seconds but
never finish, and for ``--seconds`` probes ``/health`` once a second from a fresh
connection. Reports, as JSON: how many probes answered (and their latency), the server log's
growth, and the server's open file descriptors.

    .venv/bin/python -m bench.slow_clients --connections 2100 --seconds 35

Run it from a checkout's root: the server is that checkout's ``mlxd``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port


def _start(port: int, nofile: int, fixed: bool, log: Path,
           extra: list[str]) -> subprocess.Popen[bytes]:
    hard = nofile if fixed else resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def limit() -> None:  # runs in the child before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "mlxd", "serve", "--no-preload",
                             "--port", str(port), "--log-level", "warning", *extra],
                            stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit,
                            cwd=os.getcwd())


def _wait_ready(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("server did not answer /health")


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _open_slow(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def _drip(socks: list[socket.socket], stop: threading.Event) -> None:
    """Send one more header line on every open socket every 5 s (classic slowloris)."""
    i = 0
    while not stop.wait(5):
        i += 1
        for s in list(socks):
            try:
                s.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                socks.remove(s)
                s.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(args.log)
    proc = _start(port, args.nofile, args.fixed_limit, log, args.server_args)
    try:
        _wait_ready(url, proc)
        log_before = log.stat().st_size
        socks = _open_slow(port, args.connections)
        stop = threading.Event()
        threading.Thread(target=_drip, args=(socks, stop), daemon=True).start()
        probes: list[float | None] = []
        max_fds = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            max_fds = max(max_fds, _fds(proc.pid))
            t0 = time.monotonic()
            try:
                ok = httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            probes.append(time.monotonic() - t0 if ok else None)
            time.sleep(max(0.0, 1 - (time.monotonic() - t0)))
        stop.set()
        still_open = len(socks)
        for s in socks:
            s.close()
        answered = [p for p in probes if p is not None]
        return {
            "connections_opened": args.connections, "seconds": args.seconds,
            "server_soft_nofile": args.nofile, "hard_limit_too": args.fixed_limit,
            "server_args": args.server_args,
            "health_probes": len(probes), "health_answered": len(answered),
            "health_latency_max_s": round(max(answered), 3) if answered else None,
            "health_latency_median_s": (round(sorted(answered)[len(answered) // 2], 3)
                                        if answered else None),
            "server_max_open_fds": max_fds,
            "slow_sockets_still_open_at_end": still_open,
            "log_growth_bytes": log.stat().st_size - log_before,
            "server_alive": proc.poll() is None,
        }
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=2100)
    p.add_argument("--seconds", type=float, default=35)
    p.add_argument("--nofile", type=int, default=1024, help="server's soft RLIMIT_NOFILE")
    p.add_argument("--fixed-limit", action="store_true",
                   help="set the hard limit to --nofile too (the server cannot raise it)")
    p.add_argument("--log", default="/tmp/mlxd-slow-clients.log")
    p.add_argument("server_args", nargs="*", help="extra `mlxd serve` flags (after --)")
    print(json.dumps(run(p.parse_args(argv)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
