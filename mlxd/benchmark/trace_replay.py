"""Replay recorded sessions against a server: each session's requests in order, sessions
side by side; per request TTFT, decode tok/s, prompt / cached / output tokens, and the
wall time of every session.

``/v1/messages`` requests go out as they were recorded (streamed, Anthropic SSE);
a server that only speaks OpenAI chat gets the same turns converted
(``trace_io.to_chat``), streamed with ``stream_options.include_usage``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from mlxd.benchmark.loadgen import RequestResult, Target, make_client, stream_request
from mlxd.benchmark.trace_io import TraceApi, TraceRequest, text_of, to_chat, tools_text

ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class TraceTarget:
    """The server: base URL, model name, the API to send turns to, key.

    ``tools_in_system``: describe the tools in the system message instead of sending
    ``tools`` (for servers whose chat template drops ``tools``, so that every server
    sees the same prompt).
    """

    url: str
    model: str
    api: TraceApi = "messages"
    api_key: str | None = None
    tools_in_system: bool = False


@dataclass
class SessionResult:
    """One replayed session: its requests' results and its wall time."""

    session: str
    results: list[RequestResult] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)


def request_for(target: TraceTarget, req: TraceRequest) -> dict[str, Any]:
    """The body sent for ``req``: the target's model, streamed, in the target's API."""
    body = dict(req.body, model=target.model, stream=True)
    if target.api == "messages":
        if req.api != "messages":
            raise ValueError("a chat request cannot be replayed as /v1/messages")
        if target.tools_in_system and body.get("tools"):
            system = "\n\n".join(p for p in (text_of(body.get("system") or ""),
                                              tools_text(body.pop("tools"))) if p)
            body["system"] = system
        return body
    if req.api == "messages":
        body = to_chat(body, target.tools_in_system)
    body.pop("stream_options", None)
    return dict(body, stream_options={"include_usage": True})


def _anthropic_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    if "output_tokens" in usage:
        result.completion_tokens = int(usage["output_tokens"])
    if "input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens")
        result.prompt_tokens = (int(usage["input_tokens"]) + int(cached or 0) +
                                int(usage.get("cache_creation_input_tokens") or 0))
        result.cached_tokens = None if cached is None else int(cached)


def _anthropic_event(result: RequestResult, data: str) -> bool:
    """Apply one Anthropic SSE payload; False when the stream is over."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        result.error = "bad_sse"
        return False
    kind = obj.get("type")
    if kind == "error":
        result.error = "stream_error"
        return False
    if kind == "message_start":
        _anthropic_usage(result, (obj.get("message") or {}).get("usage") or {})
    elif kind == "message_delta":
        _anthropic_usage(result, obj.get("usage") or {})
    elif kind == "content_block_delta":
        delta = obj.get("delta") or {}
        piece = delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
        if piece:
            result.chunk_times.append(time.perf_counter())
            result.text += piece
    return kind != "message_stop"


async def stream_messages(client: httpx.AsyncClient, target: TraceTarget, body: dict[str, Any],
                          result: RequestResult, timeout: float) -> RequestResult:
    """One streamed ``/v1/messages`` request, timed; never raises for server trouble."""
    headers = {"anthropic-version": ANTHROPIC_VERSION}
    if target.api_key:
        headers |= {"x-api-key": target.api_key, "Authorization": f"Bearer {target.api_key}"}

    async def go() -> None:
        async with client.stream("POST", target.url.rstrip("/") + "/v1/messages", json=body,
                                 headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"http_{resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:") and not _anthropic_event(result, line[5:].strip()):
                    break

    result.sent_at = time.perf_counter()
    try:
        await asyncio.wait_for(go(), max(0.001, timeout))
    except asyncio.TimeoutError:
        result.error = "timeout"
    except httpx.HTTPError as e:
        result.error = type(e).__name__
    result.finished_at = time.perf_counter()
    if result.ok and not result.chunk_times:
        result.error = "empty_stream"
    return result


async def send(client: httpx.AsyncClient, target: TraceTarget, req: TraceRequest, index: int,
               turn: int, timeout: float) -> RequestResult:
    """Send one recorded request to ``target`` and time it."""
    body = request_for(target, req)
    result = RequestResult(index=index, turn=turn)
    if target.api == "messages":
        return await stream_messages(client, target, body, result, timeout)
    chat = Target(url=target.url, model=target.model, api="chat", api_key=target.api_key)
    return await stream_request(client, chat, body, index=index, turn=turn, timeout=timeout,
                                result=result)


async def replay_session(client: httpx.AsyncClient, target: TraceTarget,
                         requests: list[TraceRequest], index: int, timeout: float,
                         on_result: Callable[[RequestResult], None] | None = None,
                         ) -> SessionResult:
    """A session's requests one after the other; it stops at the first failure."""
    out = SessionResult(session=requests[0].session if requests else str(index))
    out.started_at = time.perf_counter()
    for turn, req in enumerate(requests, 1):
        result = await send(client, target, req, index, turn, timeout)
        out.results.append(result)
        if on_result:
            on_result(result)
        if not result.ok:
            break
    out.finished_at = time.perf_counter()
    return out


async def replay(target: TraceTarget, sessions: list[list[TraceRequest]],
                 timeout: float = 600.0,
                 on_result: Callable[[RequestResult], None] | None = None,
                 ) -> list[SessionResult]:
    """All ``sessions`` at once (each its own sequence of requests)."""
    async with make_client(len(sessions), timeout) as client:
        return list(await asyncio.gather(*(
            replay_session(client, target, s, i, timeout, on_result)
            for i, s in enumerate(sessions))))


async def warm_up(target: TraceTarget, timeout: float = 300.0) -> RequestResult:
    """One short unrelated request (loads and compiles; shares no prefix with the trace)."""
    body = {"model": target.model, "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    req = TraceRequest("warmup", "chat" if target.api == "chat" else "messages", body)
    async with make_client(1, timeout) as client:
        return await send(client, target, req, -1, 0, timeout)
