"""Starting a sharded group and the control channel between its ranks (no MLX here).

``mlxd serve --hosts H --backend B`` re-runs itself under ``mlx.launch`` (the
launcher in the mlx wheel), which starts one process per rank with
``MLX_RANK`` set. Rank 0 serves HTTP; the other ranks follow it.

Besides MLX's own collectives (which can block forever when a peer stops),
rank 0 keeps one TCP connection per follower: it sends each decoder call over
it, and each follower sends a heartbeat back. Frames are length-prefixed JSON
(a follower never unpickles what arrives). A heartbeat missing for
``group_timeout`` seconds, or a closed connection, marks the group broken.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

_HEADER = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024  # a frame carries a prompt's tokens at most
HEARTBEAT_S = 0.5  # how often a follower says it is alive


@dataclass(frozen=True)
class GroupOptions:
    """What a rank needs to know about its group (from ``ServerConfig``)."""

    backend: str
    port: int  # rank 0's control port
    timeout: float  # seconds without a heartbeat before a rank counts as dead
    leader: str = "127.0.0.1"  # rank 0's address, as the followers reach it


def rank_of_process() -> int | None:
    """This process's rank when ``mlx.launch`` started it, else None."""
    value = os.environ.get("MLX_RANK")
    return int(value) if value is not None and value.isdigit() else None


def parse_hosts(hosts: str) -> list[str]:
    """The hosts of ``--hosts``: a comma-separated list or a hostfile (JSON, as
    ``mlx.launch`` reads it: a list of {"ssh": ..., "ips": [...]})."""
    if os.path.isfile(hosts):
        with open(hosts, encoding="utf-8") as f:
            data = json.load(f)
        entries = data.get("hosts", []) if isinstance(data, dict) else data
        out = []
        for h in entries:
            ips = h.get("ips") or [h.get("ssh")]
            out.append(str(ips[0]))
        return out
    return [h.strip() for h in hosts.split(",") if h.strip()]


def launch_command(hosts: str, backend: str, group_port: int, argv: list[str]) -> list[str]:
    """The ``mlx.launch`` command line that starts every rank of ``mlxd serve argv``.

    The ring listens on the ports after rank 0's control port; every rank runs
    this same Python, so the hosts need the same install at the same path.
    """
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    host_flag = ["--hostfile", hosts] if os.path.isfile(hosts) else ["--hosts", hosts]
    leader = parse_hosts(hosts)[0]
    return [launcher, *host_flag, "--backend", backend,
            "--starting-port", str(group_port + 1), "--python", sys.executable,
            "--env", f"MLXD_GROUP_LEADER={leader}", "--", "-m", "mlxd", *argv]


def low_latency(sock: socket.socket) -> socket.socket:
    """Send each small frame at once (Nagle's algorithm would hold a step's second
    frame for the first one's delayed ACK, tens of milliseconds per decode step)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Write one message (raises OSError when the peer is gone)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """Read one message; None when the peer closed the connection."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"control frame of {size} bytes is over the {MAX_FRAME} limit")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("control frame is not a JSON object")
    return message


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


def group_options(config: Any) -> GroupOptions | None:
    """The group settings of a ``ServerConfig`` (None when not sharded)."""
    if not config.hosts:
        return None
    leader = os.environ.get("MLXD_GROUP_LEADER") or parse_hosts(config.hosts)[0]
    return GroupOptions(config.backend, config.group_port, config.group_timeout, leader)
