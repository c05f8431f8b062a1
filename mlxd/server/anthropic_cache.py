"""Anthropic prompt caching: ``cache_control`` marks and the ``usage`` they report.

A ``cache_control`` on a tool, a system block or a message's content block
marks the prompt up to there (tools, then system, then messages, Anthropic's
order); the request's top-level ``cache_control`` marks its last message. The
marked prefix is pinned in the model's prefix cache for its TTL (``"5m"`` by
default, ``"1h"``), ahead of LRU eviction, and each use renews it
(``engines/text/prefix_cache.py``). A mark lies at the end of the message (or of
the system prompt and tools) that holds the marked block.

``usage`` counts as Anthropic does: ``cache_read_input_tokens`` came from the
cache, ``cache_creation_input_tokens`` are the marked tokens that did not and
are now written, ``input_tokens`` the rest; the three add up to the prompt.
"""

from __future__ import annotations

from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.events import Usage
from mlxd.generation.params import CacheMark
from mlxd.protocol.anthropic import MessagesInput

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_MARKS = 4  # Anthropic's limit on cache breakpoints per request


def _ttl(value: Any, param: str) -> float | None:
    """The TTL of a ``cache_control`` value (None: no mark); a malformed one is a 400."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise InvalidRequest(f"{param}: cache_control must be {{\"type\": \"ephemeral\"}} "
                             "(optionally with \"ttl\": \"5m\" or \"1h\").", param=param)
    ttl = value.get("ttl", "5m")
    if ttl not in TTL_SECONDS:
        raise InvalidRequest(f"{param}.ttl: must be \"5m\" or \"1h\", not {ttl!r}.",
                             param=f"{param}.ttl")
    return TTL_SECONDS[ttl]


def _extra(item: Any) -> Any:
    return (item.model_extra or {}).get("cache_control") if hasattr(item, "model_extra") \
        else None


def cache_marks(req: MessagesInput, canonical: Any) -> list[CacheMark]:
    """The request's marks; ``canonical(req)`` gives its canonical messages (used to
    count the canonical messages each marked Anthropic message ends)."""
    found: list[tuple[int, float]] = []  # (Anthropic messages covered, seconds)
    for i, tool in enumerate(req.tools or []):
        ttl = _ttl(_extra(tool), f"tools[{i}].cache_control")
        if ttl is not None:
            found.append((0, ttl))
    if isinstance(req.system, list):
        for i, block in enumerate(req.system):
            ttl = _ttl(_extra(block), f"system[{i}].cache_control")
            if ttl is not None:
                found.append((0, ttl))
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                ttl = _ttl(_extra(part), f"messages[{i}].content[{j}].cache_control")
                if ttl is not None:
                    found.append((i + 1, ttl))
    ttl = _ttl((req.model_extra or {}).get("cache_control"), "cache_control")
    if ttl is not None:
        found.append((len(req.messages), ttl))
    marks: list[CacheMark] = []
    system = 1 if canonical(req.model_copy(update={"messages": []}, deep=False)) else 0
    for covered, ttl_s in found[-MAX_MARKS:]:
        if covered == 0:
            marks.append(CacheMark(system, ttl_s))
        else:
            head = req.model_copy(update={"messages": req.messages[:covered]}, deep=False)
            marks.append(CacheMark(len(canonical(head)), ttl_s))
    return marks


def usage_anthropic(usage: Usage, pins: tuple[tuple[int, float], ...] = ()) -> dict[str, Any]:
    """Anthropic's usage: cache reads and writes apart from ``input_tokens``.

    ``pins``: the request's marked prefixes, (tokens, seconds); the marked tokens
    beyond what the cache supplied are this request's cache writes, split by TTL."""
    read = usage.cached_tokens
    written = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    start = read
    for length, ttl_s in sorted(pins):
        if length > start:
            bucket = "ephemeral_1h_input_tokens" if ttl_s > TTL_SECONDS["5m"] \
                else "ephemeral_5m_input_tokens"
            written[bucket] += length - start
            start = length
    creation = sum(written.values())
    return {"input_tokens": usage.prompt_tokens - read - creation,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
            "cache_creation": written}
