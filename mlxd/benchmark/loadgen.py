"""Streamed requests and closed-loop concurrency levels against an OpenAI-compatible server.

Every request is sent with ``stream=true`` and ``stream_options.include_usage``
so we see the first token (TTFT), every chunk (inter-token latency) and the
server's own token counts (``usage``, including
``prompt_tokens_details.cached_tokens`` when the server reports prefix reuse).

A level runs ``concurrency`` workers; each sends its next request as soon as
the previous one ends (closed loop) until ``requests`` were sent or the level's
``max_duration`` is over. Every request also has its own ``timeout``, so a
level always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from mlxd.benchmark.prompts import PromptSpec, first_messages, next_turn

Api = Literal["chat", "completions"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class Target:
    """The server under test: base URL (without ``/v1``), model name, API and key."""

    url: str
    model: str
    api: Api = "chat"
    api_key: str | None = None

    def endpoint(self) -> str:
        return self.url.rstrip("/") + PATHS[self.api]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Workload:
    """What every request of a run asks for.

    Args:
        spec: prompt shape (length, shared prefix, follow-up length, seed).
        max_tokens: output tokens per request.
        temperature: sampling temperature (0 = greedy).
        multi_turn: turns per conversation (1 = independent requests).
        timeout: seconds one request may take, end to end.
        max_duration: seconds after which a level starts no new request.
        drain: seconds past ``max_duration`` that requests in flight may still take
            (0: they are cut at ``max_duration`` and count as ``timeout``).
        extra_body: merged into every request body (e.g. ``{"ignore_eos": true}``).
    """

    spec: PromptSpec = field(default_factory=PromptSpec)
    max_tokens: int = 64
    temperature: float = 0.0
    multi_turn: int = 1
    timeout: float = 120.0
    max_duration: float = 600.0
    drain: float = 0.0
    extra_body: dict[str, Any] | None = None


@dataclass
class RequestResult:
    """What one streamed request did. Times are ``time.perf_counter()`` seconds."""

    index: int
    turn: int = 1
    status: int | None = None
    error: str | None = None
    retry_after: str | None = None
    sent_at: float = 0.0
    finished_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def error_key(self) -> str | None:
        """How errors are counted: the HTTP status, or a short name for other failures."""
        if self.ok:
            return None
        if self.status is not None and self.status != 200:
            return str(self.status)
        return self.error or "unknown"

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def output_tokens(self) -> int:
        """The server's count when it sent usage, else the number of content chunks."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first one over the time between first and last chunk."""
        n = self.output_tokens
        if n < 2 or len(self.chunk_times) < 2:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (n - 1) / span if span > 0 else None

    def gaps(self) -> list[float]:
        """Inter-chunk latencies (= inter-token latencies when a chunk holds one token)."""
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


def request_body(target: Target, workload: Workload, prompt: str | list[dict[str, str]],
                 max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": target.model, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": max_tokens if max_tokens is not None else workload.max_tokens,
        "temperature": workload.temperature}
    if target.api == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt if isinstance(prompt, str) else _as_text(prompt)
    body.update(workload.extra_body or {})
    return body


def _as_text(messages: list[dict[str, str]]) -> str:
    return "\n\n".join(m["content"] for m in messages)


def _chunk_piece(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or {}
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if value:
            return str(value)
    return str(choice.get("text") or "")


def _read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])


def _read_event(result: RequestResult, data: str) -> bool:
    """Apply one SSE ``data:`` payload; False when the stream is over."""
    if data == "[DONE]":
        return False
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        result.error = "bad_sse"
        return False
    if obj.get("error"):
        result.error = "stream_error"
        return False
    if obj.get("usage"):
        _read_usage(result, obj["usage"])
    pieces = [_chunk_piece(c) for c in obj.get("choices") or []]
    text = "".join(pieces)
    if text:
        result.chunk_times.append(time.perf_counter())
        result.text += text
    return True


async def _stream_into(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                       result: RequestResult) -> None:
    async with client.stream("POST", target.endpoint(), json=body,
                             headers=target.headers()) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            result.retry_after = resp.headers.get("retry-after")
            await resp.aread()
            result.error = f"http_{resp.status_code}"
            return
        async for line in resp.aiter_lines():
            if line.startswith("data:") and not _read_event(result, line[5:].strip()):
                break


async def stream_request(client: httpx.AsyncClient, target: Target, body: dict[str, Any], *,
                         index: int = 0, turn: int = 1, timeout: float = 120.0,
                         result: RequestResult | None = None) -> RequestResult:
    """Send one streamed request and time it; never raises for server or network trouble.

    Pass ``result`` to watch the request while it runs (its chunk times grow in place).
    """
    result = result or RequestResult(index=index, turn=turn)
    result.sent_at = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_into(client, target, body, result), max(0.001, timeout))
    except asyncio.TimeoutError:
        result.error = "timeout"
    except httpx.HTTPError as e:
        result.error = type(e).__name__
    result.finished_at = time.perf_counter()
    if result.status == 200 and result.error is None and not result.chunk_times:
        result.error = "empty_stream"
    return result


def make_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    """An async client sized for ``concurrency`` streams; ignores proxy variables."""
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(limits=limits, trust_env=False,
                             timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)))


@dataclass
class LevelResult:
    """All requests of one concurrency level and its wall time."""

    concurrency: int
    requests: int
    started_at: float
    finished_at: float
    results: list[RequestResult]

    @property
    def duration(self) -> float:
        return max(1e-9, self.finished_at - self.started_at)


async def _conversation(client: httpx.AsyncClient, target: Target, workload: Workload,
                        index: int, turns: int, stop_at: float,
                        on_result: Callable[[RequestResult], None]) -> list[RequestResult]:
    """Run conversation ``index`` for ``turns`` turns (1 = a single request); no turn
    starts after ``stop_at`` and none runs past ``stop_at + workload.drain``."""
    out: list[RequestResult] = []
    messages = first_messages(workload.spec, index)
    for turn in range(1, turns + 1):
        now = time.perf_counter()
        if now >= stop_at:
            break
        body = request_body(target, workload, messages)
        result = await stream_request(client, target, body, index=index, turn=turn,
                                      timeout=min(workload.timeout,
                                                  stop_at + workload.drain - now))
        out.append(result)
        on_result(result)
        if not result.ok:
            break
        messages = next_turn(messages, result.text, workload.spec, index, turn + 1)
    return out


async def run_level(target: Target, workload: Workload, concurrency: int, requests: int,
                    on_result: Callable[[RequestResult], None] | None = None,
                    first_index: int = 0) -> LevelResult:
    """Run ``requests`` requests (``multi_turn`` turns each counting as one) with
    ``concurrency`` closed-loop workers; ends by ``workload.max_duration`` at the latest."""
    callback = on_result or (lambda _r: None)
    turns = max(1, workload.multi_turn)
    jobs = math.ceil(requests / turns)
    next_job = iter(range(first_index, first_index + jobs))
    results: list[RequestResult] = []
    started = time.perf_counter()
    stop_at = started + workload.max_duration

    async def worker() -> None:
        for index in next_job:
            if time.perf_counter() >= stop_at:
                return
            results.extend(await _conversation(client, target, workload, index, turns,
                                               stop_at, callback))

    async with make_client(concurrency, workload.timeout) as client:
        tasks = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
    finished = max([r.finished_at for r in results], default=time.perf_counter())
    return LevelResult(concurrency, requests, started, finished, results)


def is_loopback_url(url: str) -> bool:
    """True when ``url`` names this machine: ``localhost``, 127.0.0.0/8 or ``::1``."""
    host = (httpx.URL(url).host or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def run_levels(target: Target, workload: Workload, concurrencies: Sequence[int],
                     requests: Callable[[int], int], warmup: int = 1,
                     on_level: Callable[[int, int], Callable[[RequestResult], None]] | None = None,
                     ) -> list[LevelResult]:
    """Warm up with ``warmup`` requests (not reported), then run each concurrency level.

    ``requests(c)`` is the request count of level ``c``; ``on_level(c, n)`` returns the
    per-request callback of that level (e.g. a progress bar's advance).
    """
    if warmup > 0:
        single = dataclasses.replace(workload, multi_turn=1)
        await run_level(target, single, 1, warmup, first_index=1_000_000)
    levels = []
    first = 0
    for c in concurrencies:
        n = requests(c)
        callback = on_level(c, n) if on_level else None
        levels.append(await run_level(target, workload, c, n, callback, first_index=first))
        first += n
    return levels
