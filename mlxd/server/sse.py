"""Server-sent events framing."""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
