"""Per-request observation: request ids, Prometheus metrics and one log line per request.

``RequestObserver`` (outermost ASGI middleware) wraps every request: it picks
the request id (the client's ``X-Request-Id`` when valid, else a new one),
returns it in the response header, and when the response ends records the
request's metrics and logs one line. Every API goes through it, so the
metrics are recorded in this one place.

What only deeper code knows (which model served the request, tokens,
time to first token, queue wait) is written into the request's
``RequestRecord`` by the model manager's hook and by ``TextSession``.
The record travels in a ``ContextVar``: asyncio copies the context into the
tasks a request spawns (a streaming body, ``n`` choices), so no route has to
pass it down. The variable holds nothing between requests: each request sets
its own record in its own context.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.generation.events import Finish
from mlxd.server.drain import Drain, run_until_cut_off, send_draining

log = logging.getLogger("mlxd.request")

REQUEST_ID_HEADER = b"x-request-id"
# Printable ASCII without spaces, at most 128 characters: safe to echo in a header and a log.
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                         0.3, 0.5, 1.0, 2.5)
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class ChoiceTiming:
    """One generated sequence's timings (seconds)."""

    queue: float | None = None  # submitted -> admitted by the scheduler
    prefill: float | None = None  # admitted -> first output
    inter_token: float | None = None  # mean gap between output tokens


@dataclass
class RequestRecord:
    """What one request did; filled in as it runs, read when its response ends."""

    request_id: str
    method: str
    path: str
    start: float = field(default_factory=time.monotonic)
    model: str = ""
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None  # request arrival -> first output event
    choices: list[ChoiceTiming] = field(default_factory=list)
    inputs_counted: bool = False  # set by encoder routes, which have no choices

    def encoded(self, tokens: int) -> None:
        """An encoder request (embeddings, rerank) read ``tokens`` input tokens."""
        self.prompt_tokens += tokens
        self.inputs_counted = True

    def first_output(self, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.start

    def finished(self, index: int, finish: Finish, started: float, first: float | None,
                 now: float) -> None:
        """One sequence ended: count its tokens and timings (index 0 carries the prompt)."""
        usage = finish.usage
        self.completion_tokens += usage.completion_tokens
        if index == 0:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
        timing = ChoiceTiming(queue=finish.queue_seconds)
        if first is not None:
            timing.prefill = max(0.0, first - started - (finish.queue_seconds or 0.0))
            if usage.completion_tokens > 1:
                timing.inter_token = (now - first) / (usage.completion_tokens - 1)
        self.choices.append(timing)


_CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "mlxd_request", default=None)


def current_record() -> RequestRecord | None:
    """The record of the request this code runs for (None outside a request)."""
    return _CURRENT.get()


def count_input_tokens(tokens: int) -> None:
    """Count an encoder request's input tokens as prompt tokens of the current request."""
    record = _CURRENT.get()
    if record is not None:
        record.encoded(tokens)


def valid_request_id(value: str | None) -> str | None:
    """``value`` when it is a usable request id (bounded, printable), else None."""
    if value is not None and _VALID_REQUEST_ID.fullmatch(value):
        return value
    return None


class RequestMetrics:
    """One app's per-request instruments, in the app's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("mlxd_requests", "HTTP requests by route, model and status",
                                ["route", "method", "model", "status"], registry=registry)
        self.duration = Histogram("mlxd_request_duration_seconds", "Whole request, to the "
                                  "last byte of the response", ["route", "model"],
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("mlxd_time_to_first_token_seconds", "Request arrival to the first "
                              "output (load, tokenize, queue and prefill included)", ["model"],
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("mlxd_queue_wait_seconds", "Sequence submitted to admitted into "
                               "the running batch", ["model"], buckets=LATENCY_BUCKETS,
                               registry=registry)
        self.prefill = Histogram("mlxd_prefill_seconds", "Admitted into the batch to the first "
                                 "output (prompt processing)", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("mlxd_inter_token_latency_seconds", "Mean gap between "
                                     "output tokens of one sequence (decode speed)", ["model"],
                                     buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens of finished "
                                     "generations", ["model"], registry=registry)
        self.cached_tokens = Counter("mlxd_cached_prompt_tokens", "Prompt tokens served from "
                                     "the prefix cache", ["model"], registry=registry)
        self.completion_tokens = Counter("mlxd_completion_tokens", "Generated tokens",
                                         ["model"], registry=registry)
        self.load_seconds = Histogram("mlxd_model_load_seconds", "Time to load a model",
                                      ["model"], buckets=LOAD_BUCKETS, registry=registry)

    # -- model manager hooks (event loop) ----------------------------------
    def requested(self, name: str) -> None:
        """A request asked for model ``name``: it is the request's model."""
        record = _CURRENT.get()
        if record is not None and not record.model:
            record.model = name

    def loaded(self, name: str, seconds: float) -> None:
        self.load_seconds.labels(name).observe(seconds)

    # -- one finished request ----------------------------------------------
    def observe(self, record: RequestRecord, route: str, duration: float) -> None:
        model = record.model
        self.requests.labels(route, record.method, model, str(record.status)).inc()
        self.duration.labels(route, model).observe(duration)
        if not model:
            return
        if record.ttft is not None:
            self.ttft.labels(model).observe(record.ttft)
        for c in record.choices:
            if c.queue is not None:
                self.queue.labels(model).observe(c.queue)
            if c.prefill is not None:
                self.prefill.labels(model).observe(c.prefill)
            if c.inter_token is not None:
                self.inter_token.labels(model).observe(c.inter_token)
        if record.choices or record.inputs_counted:
            self.prompt_tokens.labels(model).inc(record.prompt_tokens)
            self.cached_tokens.labels(model).inc(record.cached_tokens)
            self.completion_tokens.labels(model).inc(record.completion_tokens)


def route_templates(app: Any) -> list[tuple[re.Pattern[str], str]]:
    """Each documented path template with a pattern matching the paths it serves."""
    out = []
    schema: dict[str, Any] = app.openapi() if hasattr(app, "openapi") else {}
    for template in schema.get("paths", {}):
        pattern = re.sub(r"\\\{[^}]+\\\}", ".+", re.escape(template))
        out.append((re.compile(pattern), template))
    return out


class RequestObserver:
    """Outermost middleware: request id, per-request metrics and the request log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    def route_of(self, scope: Scope) -> str:
        """The route template that served (or would serve) the request: a bounded label."""
        route = getattr(scope.get("route"), "path", None)
        if route:
            return str(route)
        # refused before routing (auth, body limit): the documented path it was sent to
        if self._templates is None:
            self._templates = route_templates(scope.get("app"))
        path = scope.get("path", "")
        return next((t for pattern, t in self._templates if pattern.fullmatch(path)),
                    "unmatched")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                          if k == REQUEST_ID_HEADER), None)
        request_id = valid_request_id(presented) or uuid.uuid4().hex
        record = RequestRecord(request_id, scope.get("method", ""), scope.get("path", ""))
        # read by the error handler, whose 500s are sent outside this middleware
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        ctx = getattr(getattr(scope.get("app"), "state", None), "ctx", None)
        drain: Drain | None = getattr(ctx, "drain", None)
        token = _CURRENT.set(record)
        if drain is not None:
            drain.in_flight += 1  # what the drain phase waits for (server/drain.py)
        try:
            if drain is None:
                await self.app(scope, receive, send_with_id)
            elif drain.refuses(scope):
                await send_draining(scope, receive, send_with_id)
            else:  # a 503 or a final error event if shutdown cuts it off
                await run_until_cut_off(self.app, scope, receive, send_with_id, drain)
        except BaseException:
            if not record.status:
                record.status = 500
            raise
        finally:
            if drain is not None:
                drain.in_flight -= 1
            _CURRENT.reset(token)
            self._done(scope, record)

    def _done(self, scope: Scope, record: RequestRecord) -> None:
        duration = time.monotonic() - record.start
        route = self.route_of(scope)
        ctx = getattr(getattr(scope.get("app"), "state", None), "ctx", None)
        metrics: RequestMetrics | None = getattr(ctx, "request_metrics", None)
        if metrics is not None:
            metrics.observe(record, route, duration)
        log_request(record, route, duration)


def log_request(record: RequestRecord, route: str, duration: float) -> None:
    """One line per request: text for people, fields for ``--log-format json``."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {
        "request_id": record.request_id, "method": record.method, "path": record.path,
        "route": route, "model": record.model or None, "status": record.status,
        "duration_s": round(duration, 6),
        "ttft_s": None if record.ttft is None else round(record.ttft, 6),
        "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
    }
    text = (f"{record.method} {record.path} {record.status} model={record.model or '-'} "
            f"prompt={record.prompt_tokens} completion={record.completion_tokens} "
            f"cached={record.cached_tokens} ttft={fields['ttft_s']} "
            f"duration={duration:.3f}s id={record.request_id}")
    log.info(text, extra={"mlxd_fields": fields})
