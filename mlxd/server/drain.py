"""Graceful shutdown: the drain phase between SIGTERM and uvicorn's own shutdown.

On the first SIGTERM/SIGINT the server keeps its listener open and enters a drain phase
(``GuardedServer.handle_exit``): every new request is answered 503 with ``Retry-After``
in its API's error shape and ``/health`` reports ``draining`` with 503, so load
balancers take the replica out, while requests already in flight run to completion.
Once none is in flight, or ``--drain-timeout`` has passed, uvicorn's normal shutdown
proceeds (listener closed, lifespan shutdown: prefix caches saved). A second signal
exits at once. ``RequestObserver`` (the outermost middleware) counts requests in flight
and sends the refusals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from mlxd.errors import Overloaded
from mlxd.server.errors import error_response

DRAIN_EXEMPT = frozenset({"/health", "/healthz"})  # they report the drain instead
RETRY_AFTER_S = 5.0  # long enough for a load balancer to route elsewhere


@dataclass
class Drain:
    """One server's drain state: whether it is draining, and requests in flight."""

    draining: bool = False
    in_flight: int = 0
    deadline: float = 0.0  # time.monotonic() at which the drain gives up waiting

    def begin(self, timeout: float) -> None:
        """Start draining (idempotent): refuse new requests from now on."""
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + timeout

    def done(self) -> bool:
        """Whether the drain is over: nothing in flight, or the timeout has passed."""
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)

    def refuses(self, scope: Scope) -> bool:
        """Whether this new request is refused (draining, and not a health check)."""
        return self.draining and scope.get("path", "") not in DRAIN_EXEMPT


async def send_draining(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer 503 + Retry-After in the API's error shape (Overloaded, as a full queue is)."""
    exc = Overloaded("The server is shutting down; retry on another replica.",
                     retry_after=RETRY_AFTER_S, code="shutting_down")
    response = error_response(Request(scope), exc.status, exc.message, error_type=exc.error_type,
                              code=exc.code, headers=exc.headers)
    await response(scope, receive, send)
