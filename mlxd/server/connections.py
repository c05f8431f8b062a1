"""Connection hygiene for uvicorn: slow-client timeouts, a connection cap, quiet accept errors.

uvicorn's h11 protocol has no deadline for request headers, so clients that connect and send
headers slowly (or never) each hold a socket forever; a few thousand exhaust the process's
open files, after which ``accept()`` fails and asyncio logs a traceback for every retry.
``GuardedH11Protocol`` adds, per connection:

- a header deadline: the whole request head must arrive within ``header_timeout`` of the
  connection starting to wait for it (408, then close), like nginx's ``client_header_timeout``;
- a body timeout: the body may stall at most ``body_timeout`` between reads (408 if no
  response has started, then close), like nginx's ``client_body_timeout``;
- a cap of ``max_connections`` open connections: at the cap, a new connection displaces the
  oldest one that is waiting for a request (slow or idle), or is refused with 503 when every
  connection is busy, so ordinary clients (and ``/health``) still get through.

``ConnectionGuard`` holds the limits and the per-server state; it also counts repeated events
(timeouts, refusals, ``accept()`` failures) and logs each kind once per interval with a count.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxd.config import ServerConfig
from mlxd.server.drain import CUT_OFF_GRACE_S, Drain

DEFAULT_MAX_CONNECTIONS = 1024
MIN_MAX_CONNECTIONS = 8
LOG_INTERVAL_S = 10.0
REFUSED_LINGER_S = 1.0
MAX_BACKLOG = 2048  # uvicorn's default listen backlog
MIN_BACKLOG = 16
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"content-length: 15\r\nconnection: close\r\n\r\nRequest Timeout")
SERVER_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
               b"content-length: 29\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
               b"Too many connections; retry.\n")

logger = logging.getLogger("mlxd.connections")


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; return (soft, hard).

    macOS refuses RLIM_INFINITY (and values above kern.maxfilesperproc), so fall back to
    smaller targets; any refusal leaves the limit as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 65536, 10240):
        if target == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def fd_reserve(soft: int) -> int:
    """File descriptors kept back from connections: model files, logs, stdio, the listener."""
    return max(64, soft // 4)


def connection_limit(configured: int | None, soft: int) -> int:
    """The connection cap: ``configured``, or the default kept below the open-file limit."""
    if configured is not None:
        return configured
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(MIN_MAX_CONNECTIONS, min(DEFAULT_MAX_CONNECTIONS, soft - fd_reserve(soft)))


class RateLimitedLog:
    """Log each kind of event at once, then at most once per ``interval`` with a count."""

    def __init__(self, log: logging.Logger, interval: float = LOG_INTERVAL_S) -> None:
        self.log = log
        self.interval = interval
        self._pending: dict[str, int] = {}  # message -> events not yet reported in this window

    def event(self, message: str, level: int = logging.WARNING) -> None:
        """Record one event: logged now if none of its kind was logged this interval."""
        if message in self._pending:
            self._pending[message] += 1
            return
        self.log.log(level, message)
        self._pending[message] = 0
        asyncio.get_running_loop().call_later(self.interval, self._flush, message, level)

    def _flush(self, message: str, level: int) -> None:
        count = self._pending.pop(message, 0)
        if count:  # events kept coming: report them and keep the window open
            self.log.log(level, "%s (%d more in the last %.0f s)", message, count, self.interval)
            self._pending[message] = 0
            asyncio.get_running_loop().call_later(self.interval, self._flush, message, level)


class ConnectionGuard:
    """Limits and shared state of one server's connections (see the module docstring)."""

    def __init__(self, header_timeout: float, body_timeout: float, max_connections: int,
                 log_interval: float = LOG_INTERVAL_S) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.open: set[GuardedH11Protocol] = set()
        # connections waiting for a request, oldest first: the ones to displace at the cap
        self.waiting: dict[GuardedH11Protocol, None] = {}
        self.events = RateLimitedLog(logger, log_interval)

    def protocol_class(self) -> type[GuardedH11Protocol]:
        """A uvicorn ``http`` protocol class bound to this guard."""
        class BoundGuardedH11Protocol(GuardedH11Protocol):
            guard = self

        return BoundGuardedH11Protocol

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Count a new connection; at the cap, displace the oldest waiting one or refuse."""
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self.events.event(f"refused connections: all {self.max_connections} "
                                  "connections are busy (--max-connections)")
                return False
            oldest = next(iter(self.waiting))
            self.events.event(f"closed idle or slow connections to admit new ones "
                              f"({self.max_connections} open, --max-connections)")
            oldest.close_now()
        self.open.add(conn)
        return True

    def forget(self, conn: GuardedH11Protocol) -> None:
        """Stop counting a connection (closing or closed)."""
        self.open.discard(conn)
        self.waiting.pop(conn, None)

    def exception_handler(self, previous: Callable[..., Any] | None) -> Callable[..., None]:
        """An asyncio exception handler that logs out-of-resource accept errors once per
        interval (asyncio logs a traceback per retry, up to the backlog per loop tick)."""

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS \
                    and "accept" in context.get("message", ""):
                self.events.event(f"accept() failed: {exc.strerror}; retrying", logging.ERROR)
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        return handle


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines and the guard's connection cap."""

    guard: ConnectionGuard  # set by ConnectionGuard.protocol_class()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            self._refuse()
            return
        self._track()

    def _refuse(self) -> None:
        """Answer 503 and close once the client has stopped sending (or after a second):
        closing with its request unread would reset the connection and lose the 503."""
        self._refused = True
        self.transport.write(SERVER_BUSY)
        self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # discarded: the 503 is already on its way
        super().data_received(data)
        self._track(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def close_now(self) -> None:
        """Close this connection at once (displaced at the cap)."""
        self._cancel_timers()
        self.guard.forget(self)
        if not self.transport.is_closing():
            self.transport.close()

    def _track(self, progress: bool = False) -> None:
        """Arm the timer that fits where the request is; a body timer restarts on progress."""
        if self.transport.is_closing():
            self._cancel_timers()
            self.guard.forget(self)
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for a request head: one deadline for all of it
            self._cancel_body_timer()
            if self._header_timer is None:
                self.guard.waiting[self] = None
                self._header_timer = self.loop.call_later(self.guard.header_timeout,
                                                          self._header_timed_out)
            return
        self.guard.waiting.pop(self, None)
        self._cancel_header_timer()
        if state is h11.SEND_BODY:
            if progress or self._body_timer is None:
                self._cancel_body_timer()
                self._body_timer = self.loop.call_later(self.guard.body_timeout,
                                                        self._body_timed_out)
        else:
            self._cancel_body_timer()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.events.event(f"closed connections that sent no complete request head "
                                f"within {self.guard.header_timeout:g} s (--header-timeout)")
        self.transport.write(REQUEST_TIMEOUT)
        self.close_now()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        # not the client's fault when we stopped reading (the app is behind) or the client
        # waits for our "100 Continue" (the app has not asked for the body yet)
        if self.flow.read_paused or (self.cycle is not None
                                     and self.cycle.waiting_for_100_continue):
            self._body_timer = self.loop.call_later(self.guard.body_timeout,
                                                    self._body_timed_out)
            return
        self.guard.events.event(f"closed connections whose request body stalled for "
                                f"{self.guard.body_timeout:g} s (--body-timeout)")
        if self.cycle is not None:
            if not self.cycle.response_started:
                self.transport.write(REQUEST_TIMEOUT)
            # the app sees a client disconnect; anything it sends now is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.close_now()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()


class GuardedServer(uvicorn.Server):
    """A uvicorn server that installs its guard's accept-error handler on its loop."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets: Any = None) -> None:
        """Install the exception handler, then start as uvicorn does."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self.guard.exception_handler(loop.get_exception_handler()))
        await super().startup(sockets)

    def _drain(self) -> Drain | None:
        ctx = getattr(getattr(self.config.app, "state", None), "ctx", None)
        return getattr(ctx, "drain", None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain (server/drain.py) while the listener stays open; a second
        one exits at once, skipping the wait for in-flight requests."""
        drain = self._drain()
        if drain is None or not self.started or self.should_exit:
            super().handle_exit(sig, frame)
            if self.should_exit and drain is not None and drain.draining:
                self.force_exit = True  # uvicorn forces only on a second SIGINT
            return
        self._captured_signals.append(sig)
        if drain.draining:  # second signal while draining
            self.should_exit = self.force_exit = True
            return
        drain.begin(self.config.timeout_graceful_shutdown or 0.0)
        logger.info("draining: refusing new requests with 503 until the %d in flight finish "
                    "(--drain-timeout %gs)", drain.in_flight,
                    self.config.timeout_graceful_shutdown or 0.0)

    async def on_tick(self, counter: int) -> bool:
        """Also end the drain (every 0.1 s tick) once nothing is in flight or its time is up
        (then what is in flight is cut off with 503s); uvicorn's shutdown then gets what is
        left of --drain-timeout, or the cut-off's grace."""
        drain = self._drain()
        if drain is not None and not self.should_exit and drain.done():
            self.should_exit = True
            left = drain.deadline - time.monotonic()
            grace = 1.0
            if drain.in_flight:  # the deadline passed: they get their 503s before uvicorn
                drain.cut()      # would cancel them (server/drain.py)
                logger.info("drain timeout: cutting off %d request(s) still in flight",
                            drain.in_flight)
                grace = CUT_OFF_GRACE_S
            self.config.timeout_graceful_shutdown = math.ceil(max(grace, left))
        return await super().on_tick(counter)


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (``OSError`` if taken), for ``server.serve(sockets=[...])``.

    ``mlxd serve`` binds before it converts and loads models, so a port in use fails in
    a second with one line instead of after minutes of loading. It listens only when
    uvicorn starts: until then a client is refused rather than left waiting.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def guarded_server(app: Any, config: ServerConfig,
                   server_class: type[GuardedServer] = GuardedServer,
                   **uvicorn_kwargs: Any) -> GuardedServer:
    """A uvicorn server for ``app`` on ``config``'s address with the guard wired in; raises
    the soft open-file limit first (a process-wide, one-way change)."""
    soft, _ = raise_nofile_limit()
    cap = connection_limit(config.max_connections, soft)
    backlog = MAX_BACKLOG
    if soft != resource.RLIM_INFINITY:
        reserve = fd_reserve(soft)
        if cap > soft - reserve:
            logger.warning("--max-connections %d leaves fewer than %d of the %d open files "
                           "for everything else: accept() may fail under load", cap, reserve,
                           soft)
        # asyncio accepts up to `backlog` sockets per loop tick before any is admitted, and
        # those they displace close a tick later: keep two bursts inside the reserve. (On
        # EMFILE, asyncio also retries accept() `backlog` times per tick.)
        backlog = max(MIN_BACKLOG, min(MAX_BACKLOG, reserve // 4))
    guard = ConnectionGuard(config.header_timeout, config.body_timeout, cap,
                            config.log_repeat_interval)
    # ws="none": a websocket upgrade would hand the socket to a protocol the guard cannot see
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               http=guard.protocol_class(), ws="none", backlog=backlog,
                               **uvicorn_kwargs)
    return server_class(uv_config, guard)
