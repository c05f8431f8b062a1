"""Rank 0's end of the control channel: one connection per follower rank.

Rank 0 sends every decoder call to the followers before making it itself, so
all ranks reach MLX's collectives together. A reader thread per follower
takes its heartbeats; a closed connection, an error report or a heartbeat
missing for ``timeout`` seconds marks the group broken, which fails waiting
requests at once (``on_failure`` callbacks) instead of leaving them behind a
collective that may never return.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.runtime.distributed import GroupOptions, low_latency, recv_frame, send_frame

log = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A rank of the group died or stopped answering; the group cannot decode."""


@dataclass
class FollowerState:
    """What rank 0 knows of one follower."""

    rank: int
    pid: int
    sock: socket.socket
    memory_bytes: int = 0
    last_beat: float = field(default_factory=time.monotonic)
    acks: dict[str, Any] = field(default_factory=dict)


class GroupLink:
    """Connections to the ``size - 1`` follower ranks of one group."""

    def __init__(self, options: GroupOptions, size: int) -> None:
        self.options = options
        self.size = size
        self.followers: dict[int, FollowerState] = {}
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._callbacks: list[Callable[[str], None]] = []
        self._listener: socket.socket | None = None

    def connect(self, deadline_s: float) -> None:
        """Listen on the control port and accept every follower (they retry until then)."""
        listener = socket.create_server((self.options.leader, self.options.port),
                                        reuse_port=False)
        listener.settimeout(1.0)
        self._listener = listener
        deadline = time.monotonic() + deadline_s
        while len(self.followers) < self.size - 1:
            if time.monotonic() > deadline:
                raise GroupBroken(f"only {len(self.followers)} of {self.size - 1} ranks "
                                  f"connected to port {self.options.port} in {deadline_s:.0f} s")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            low_latency(sock).settimeout(self.options.timeout)
            hello = recv_frame(sock)
            if not hello or hello.get("op") != "hello":
                sock.close()
                continue
            state = FollowerState(int(hello["rank"]), int(hello["pid"]), sock)
            self.followers[state.rank] = state
        for state in self.followers.values():
            threading.Thread(target=self._read, args=(state,), daemon=True,
                             name=f"mlxd-group-rank{state.rank}").start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from a reader thread) when the group breaks."""
        with self._lock:
            self._callbacks.append(callback)
            failed = self.failed
        if failed is not None:
            callback(failed)

    def send(self, message: dict[str, Any]) -> None:
        """Send ``message`` to every follower; ``GroupBroken`` if the group is broken."""
        if self.failed is not None:
            raise GroupBroken(self.failed)
        for state in list(self.followers.values()):
            try:
                send_frame(state.sock, message)
            except OSError as e:
                self.fail(f"rank {state.rank} is unreachable ({e})")
                raise GroupBroken(self.failed or "") from e

    def wait_acks(self, op: str, timeout: float) -> list[Any]:
        """Wait until every follower has acknowledged ``op``; their answers."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(op in s.acks for s in self.followers.values()):
                if self.failed is not None:
                    raise GroupBroken(self.failed)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GroupBroken(f"ranks did not finish '{op}' within {timeout:.0f} s")
                self._changed.wait(left)
            return [s.acks.pop(op) for s in self.followers.values()]

    def fail(self, reason: str) -> None:
        """Mark the group broken (once) and tell whoever waits."""
        with self._changed:
            if self.failed is not None:
                return
            self.failed = reason
            callbacks = list(self._callbacks)
            self._changed.notify_all()
        log.error("sharded group is broken: %s", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("group failure callback failed")

    def _read(self, state: FollowerState) -> None:
        while self.failed is None:
            try:
                message = recv_frame(state.sock)
            except TimeoutError:
                self.fail(f"rank {state.rank} (pid {state.pid}) sent no heartbeat for "
                          f"{self.options.timeout:.0f} s")
                return
            except (OSError, ValueError) as e:
                self.fail(f"rank {state.rank} (pid {state.pid}) connection failed: {e}")
                return
            if message is None:
                self.fail(f"rank {state.rank} (pid {state.pid}) closed its connection "
                          "(the process ended)")
                return
            self._take(state, message)

    def _take(self, state: FollowerState, message: dict[str, Any]) -> None:
        op = message.get("op")
        with self._changed:
            state.last_beat = time.monotonic()
            if op == "beat":
                state.memory_bytes = int(message.get("memory_bytes", 0))
            elif op == "error":
                pass
            elif isinstance(op, str):
                state.acks[op] = message
            self._changed.notify_all()
        if op == "error":
            self.fail(f"rank {state.rank} failed: {message.get('error')}")

    def info(self) -> list[dict[str, Any]]:
        """Each follower's rank, pid, memory and seconds since its last heartbeat."""
        now = time.monotonic()
        with self._lock:
            return [{"rank": s.rank, "pid": s.pid, "memory_bytes": s.memory_bytes,
                     "last_heartbeat_s": round(now - s.last_beat, 3)}
                    for s in sorted(self.followers.values(), key=lambda s: s.rank)]

    def close(self) -> None:
        """Close every connection (the followers then end: a group forms once)."""
        with self._changed:
            if self.failed is None:
                self.failed = "the group was closed"
            self._changed.notify_all()
        for state in self.followers.values():
            state.sock.close()
        if self._listener is not None:
            self._listener.close()
