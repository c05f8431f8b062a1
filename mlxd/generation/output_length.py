"""How many tokens a request may generate: one rule for every API.

- No limit in the request (Codex never sends ``max_output_tokens``): the
  server's default when one is configured (``--max-tokens``, or a registry
  entry's ``defaults.max_tokens``; filled in once by ``server/request_policy.py``
  before the engine sees the request), else the rest of the context.
- A limit larger than the room the prompt leaves is capped to that room, as
  llama-server and vLLM-style local servers do; generation then ends at the
  end of the context (``finish_reason: length``, Responses ``incomplete``,
  Anthropic ``model_context_window_exceeded``).
- Only a prompt that alone fills the context is refused (a 400).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OutputLimit:
    """``tokens``: the most this request generates; ``context_limited``: the context,
    not the request or the server's default, set that number."""

    tokens: int
    context_limited: bool


def output_limit(context_length: int, prompt_tokens: int, requested: int | None) -> OutputLimit:
    """The limit for a prompt of ``prompt_tokens`` that fits the context (checked before);
    ``requested`` None: the rest of the context."""
    room = context_length - prompt_tokens
    if requested is None or requested > room:
        return OutputLimit(room, context_limited=True)
    return OutputLimit(requested, context_limited=False)
