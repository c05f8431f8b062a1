"""Graceful shutdown: the drain phase between SIGTERM and uvicorn's own shutdown.

On the first SIGTERM/SIGINT the server keeps its listener open and enters a drain phase
(``GuardedServer.handle_exit``): every new request is answered 503 with ``Retry-After``
in its API's error shape and ``/health`` reports ``draining`` with 503, so load
balancers take the replica out, while requests already in flight run to completion.
Once none is in flight, or ``--drain-timeout`` has passed, uvicorn's normal shutdown
proceeds (listener closed, lifespan shutdown: prefix caches saved). A second signal
exits at once. ``RequestObserver`` (the outermost middleware) counts requests in flight
and sends the refusals.

Requests still in flight at the deadline are *cut off* here, before uvicorn would cancel
them (a plain-text 500 and "Exception in ASGI application"): each is cancelled (its engine
work stops at the next step or window) and ends with a 503 in its API's error shape, or,
when its response has started as a stream, with a final error event in its API's format.
uvicorn then gets ``CUT_OFF_GRACE_S`` for those answers to go out, and the lifespan
shutdown closes the engines, so the process exits within the drain timeout plus that
grace plus the engines' close (one decode step or audio window; at most
``ModelManager.shutdown``'s bound).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.errors import Overloaded
from mlxd.server.errors import error_body, error_response
from mlxd.server.sse import sse_data, sse_event

DRAIN_EXEMPT = frozenset({"/health", "/healthz"})  # they report the drain instead
RETRY_AFTER_S = 5.0  # long enough for a load balancer to route elsewhere
CUT_OFF_GRACE_S = 3.0  # after the cut-off, for the 503s and error events to go out
CANCEL_WAIT_S = 1.0  # for a cut-off request's handler to unwind before its 503 is sent


@dataclass
class Drain:
    """One server's drain state: whether it is draining, and requests in flight."""

    draining: bool = False
    in_flight: int = 0
    deadline: float = 0.0  # time.monotonic() at which the drain gives up waiting
    cut_off: asyncio.Event = field(default_factory=asyncio.Event)  # set at the deadline

    def begin(self, timeout: float) -> None:
        """Start draining (idempotent): refuse new requests from now on."""
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + timeout

    def done(self) -> bool:
        """Whether the drain is over: nothing in flight, or the timeout has passed."""
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)

    def cut(self) -> None:
        """The deadline passed with requests in flight: cut them off (``run_until_cut_off``)."""
        self.cut_off.set()

    def refuses(self, scope: Scope) -> bool:
        """Whether this new request is refused (draining, and not a health check)."""
        return self.draining and scope.get("path", "") not in DRAIN_EXEMPT


def _shutting_down(message: str = "The server is shutting down; retry on another "
                                   "replica.") -> Overloaded:
    return Overloaded(message, retry_after=RETRY_AFTER_S, code="shutting_down")


async def send_draining(scope: Scope, receive: Receive, send: Send,
                        exc: Overloaded | None = None) -> None:
    """Answer 503 + Retry-After in the API's error shape (Overloaded, as a full queue is)."""
    exc = exc or _shutting_down()
    response = error_response(Request(scope), exc.status, exc.message, error_type=exc.error_type,
                              code=exc.code, headers=exc.headers)
    await response(scope, receive, send)


def stream_error_event(scope: Scope, exc: Overloaded) -> str:
    """The final event of a stream cut off by shutdown, in its API's format."""
    path = scope.get("path", "")
    body = error_body(Request(scope), exc.status, exc.message, error_type=exc.error_type,
                      code=exc.code)
    if path.startswith("/v1/messages"):  # Anthropic: event: error
        return sse_event("error", body)
    if path.startswith("/v1/responses"):  # Responses: event: error, the error's fields flat
        return sse_event("error", {"type": "error", **body["error"]})
    if path.startswith("/v1/audio/"):  # transcription streams
        return sse_data({"type": "error", **body})
    return sse_data(body)  # chat / completions: what their own mid-stream errors send


async def run_until_cut_off(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                            drain: Drain) -> None:
    """Run ``app``; if the drain cuts the request off first, cancel it and end its response
    with a 503 in its API's shape (not started yet), or a final error event (an SSE stream),
    or unfinished (another started body: the client sees it cut, not complete)."""
    state: dict[str, Any] = {"started": False, "ended": False, "sse": False, "cut": False}

    async def tracking_send(message: Message) -> None:
        if state["cut"]:
            return  # the handler unwinding after the cut-off: its output is dropped
        if message["type"] == "http.response.start":
            state["started"] = True
            state["sse"] = any(k.lower() == b"content-type" and b"text/event-stream" in v
                               for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            state["ended"] = True
        await send(message)

    task = asyncio.ensure_future(app(scope, receive, tracking_send))
    cut = asyncio.ensure_future(drain.cut_off.wait())
    try:
        await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        cut.cancel()
    if task.done():
        task.result()  # the handler's own outcome (its exception, if any)
        return
    state["cut"] = True
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
    if not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    exc = _shutting_down("The server is shutting down and cut this request off after "
                         "--drain-timeout; retry on another replica.")
    if not state["started"]:
        await send_draining(scope, receive, send, exc)
    elif state["sse"] and not state["ended"]:
        await send({"type": "http.response.body", "more_body": False,
                    "body": stream_error_event(scope, exc).encode()})
