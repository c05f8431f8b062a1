"""Server-sent events framing, and the keep-alive every text stream shares."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


def sse_data(payload: dict[str, Any] | str) -> str:
    """``data: {...}\\n\\n`` (OpenAI style)."""
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {body}\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> str:
    """``event: NAME\\ndata: {...}\\n\\n`` (Anthropic and Responses style)."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# A comment line: proxies and HTTP clients see bytes, SSE parsers see no event.
SSE_COMMENT_KEEPALIVE = ": keep-alive\n\n"


async def with_keepalive(events: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """``events`` as they come, and ``None`` each time ``interval`` seconds pass without one.

    A long prompt's prefill (or a batch stalled by another request's prefill) produces
    no event for minutes; the caller turns each ``None`` into its API's keep-alive so
    that clients with an idle timeout (Codex re-sends the whole request after one) keep
    waiting. The next event is awaited in a task that a keep-alive does not disturb;
    closing this iterator (a client disconnect) cancels that task and closes ``events``,
    which cancels the generation, during prefill as well.
    """
    iterator = aiter(events)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
