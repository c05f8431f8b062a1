"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages adapter.

Pipeline events become content blocks: ``ReasoningDelta`` -> ``thinking``,
``TextDelta`` -> ``text``, ``ToolCall`` -> ``tool_use``. One ``ContentBlocks``
assembler serves the streaming and the non-streaming response, so both carry
the same blocks. Errors are rendered in Anthropic's shape by
``server/errors.py`` (it switches on the ``/v1/messages`` path).

``max_tokens`` is capped to the context the prompt leaves, as in every API
(``generation/output_length.py``): generation then stops at the end of the
context with ``stop_reason: model_context_window_exceeded`` (clients such as
Claude Code ask for more output tokens than a small local model's context holds).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.errors import ContextOverflow, GenerationFailed, InvalidRequest
from mlxd.generation.events import Event, Finish, ReasoningDelta, TextDelta, ToolCall, Usage
from mlxd.generation.truncated import parse_partial_json
from mlxd.protocol.anthropic import CountTokensRequest, MessagesInput, MessagesRequest
from mlxd.server.anthropic_cache import usage_anthropic
from mlxd.server.anthropic_input import generation_request
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.errors import anthropic_error_type
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.sse import SSE_HEADERS, sse_event
from mlxd.server.text_session import TextSession, finish_of

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/messages"
COUNT_ENDPOINT = "/v1/messages/count_tokens"

SSE = tuple[str, dict[str, Any]]  # (event name, payload)


class ContentBlocks:
    """Assembles content blocks from events; ``feed``/``close`` return the stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None

    def feed(self, event: Event) -> list[SSE]:
        if isinstance(event, ReasoningDelta) and event.text:
            return self._delta("thinking", event.text)
        if isinstance(event, TextDelta) and event.text:
            return self._delta("text", event.text)
        if isinstance(event, ToolCall):
            return self._tool_use(event)
        return []

    def close(self) -> list[SSE]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        self._open = None
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _start(self, block: dict[str, Any], empty: dict[str, Any]) -> SSE:
        self.blocks.append(block)
        self._open = block["type"]
        return ("content_block_start", {"type": "content_block_start",
                                        "index": len(self.blocks) - 1, "content_block": empty})

    def _delta(self, kind: str, text: str) -> list[SSE]:
        events: list[SSE] = []
        if self._open != kind:
            events += self.close()
            if kind == "thinking":
                events.append(self._start({"type": "thinking", "thinking": "", "signature": ""},
                                          {"type": "thinking", "thinking": "", "signature": ""}))
            else:
                events.append(self._start({"type": "text", "text": ""},
                                          {"type": "text", "text": ""}))
        self.blocks[-1][kind] += text
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        events.append(("content_block_delta", {"type": "content_block_delta",
                                                "index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _tool_use(self, call: ToolCall) -> list[SSE]:
        events = self.close()
        arguments = tool_input(call)
        events.append(self._start(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments},
            {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))
        index = len(self.blocks) - 1
        events.append(("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta",
                      "partial_json": json.dumps(arguments, ensure_ascii=False)}}))
        events += self.close()
        return events


def tool_input(call: ToolCall) -> dict[str, Any]:
    """``tool_use.input`` must be an object. A call cut off by ``max_tokens`` gets the
    best-effort value of its partial arguments (open strings and containers closed,
    an incomplete last member dropped), ``{}`` when nothing is readable."""
    if not call.complete:
        value = parse_partial_json(call.arguments)
        return value if isinstance(value, dict) else {}
    arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def stop_reason(finish: Finish, clamped: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` for a finished sequence."""
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.stop_sequence:
        return "stop_sequence", finish.stop_sequence
    if finish.reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    return "end_turn", None


def clamp_max_tokens(session: TextSession, max_tokens: int) -> bool:
    """True when the context, not ``max_tokens``, is the limit (the request policy
    capped it when the prompt was prepared)."""
    return max_tokens > 0 and session.context_limited


def _message(mid: str, model: str, content: list[dict[str, Any]], reason: str | None,
             sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage}


def _new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


async def _nothing(session: TextSession) -> AsyncIterator[tuple[int, Event]]:
    """``max_tokens: 0``: the prompt was checked and counted; nothing is generated."""
    yield 0, Finish("length", Usage(session.prompt_tokens, 0))


def _events(session: TextSession,
            max_tokens: int) -> AsyncIterator[tuple[int, Event] | None]:
    return session.stream() if max_tokens > 0 else _nothing(session)


async def _respond(session: TextSession, request: Request, req: MessagesRequest,
                   clamped: bool) -> JSONResponse:
    try:
        if req.max_tokens > 0:
            events = (await session.collect(request))[0]
        else:
            events = [event async for _, event in _nothing(session)]
    finally:
        await session.close()
    finish = finish_of(events)
    if finish.reason == "error":
        raise GenerationFailed(finish.error or "generation failed")
    blocks = ContentBlocks()
    for event in events:
        blocks.feed(event)
    reason, sequence = stop_reason(finish, clamped)
    return JSONResponse(_message(_new_id(), req.model, blocks.blocks, reason, sequence,
                                 usage_anthropic(finish.usage, session.cache_pins)))


async def _stream(session: TextSession, req: MessagesRequest,
                  clamped: bool) -> AsyncIterator[str]:
    """message_start, ping, content blocks, message_delta, message_stop."""
    # the cache's part is estimated now; message_delta carries the counts as they were
    prompt = Usage(session.prompt_tokens, 0, cached_tokens=session.engine.cached_tokens(
        session.prepared))
    yield sse_event("message_start", {"type": "message_start", "message": _message(
        _new_id(), req.model, [], None, None, usage_anthropic(prompt, session.cache_pins))})
    yield sse_event("ping", {"type": "ping"})
    blocks = ContentBlocks()
    async for item in _events(session, req.max_tokens):
        if item is None:
            yield sse_event("ping", {"type": "ping"})
            continue
        event = item[1]
        if not isinstance(event, Finish):
            for name, payload in blocks.feed(event):
                yield sse_event(name, payload)
            continue
        if event.reason == "error":
            yield sse_event("error", {"type": "error", "error": {
                "type": "api_error", "message": event.error or "generation failed"}})
            return
        for name, payload in blocks.close():
            yield sse_event(name, payload)
        reason, sequence = stop_reason(event, clamped)
        yield sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_anthropic(event.usage, session.cache_pins)})
        yield sse_event("message_stop", {"type": "message_stop"})


def _stream_error(error: StreamError) -> str:
    return sse_event("error", {"type": "error", "error": {
        "type": anthropic_error_type(error.status), "message": error.message}})


def prompt_too_long(error: ContextOverflow) -> InvalidRequest:
    """Anthropic's words for a prompt that does not fit, the ones Claude Code compacts
    its history on. The maximum is the most a prompt may take: the context less the
    one token an answer needs."""
    return InvalidRequest(f"prompt is too long: {error.prompt_tokens} tokens > "
                          f"{error.context - 1} maximum", param=error.param,
                          code=error.code)


async def _open(ctx: ServerContext, req: MessagesInput, endpoint: str) -> TextSession:
    gen = generation_request(req)
    try:
        return await TextSession.open(ctx, req.model, gen, endpoint=endpoint)
    except ContextOverflow as e:
        if endpoint == COUNT_ENDPOINT and e.counted:
            raise CountedOverflow(e.prompt_tokens) from e
        raise prompt_too_long(e) from e


class CountedOverflow(Exception):
    """count_tokens of a prompt beyond the context: the count is the answer."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.tokens = tokens


@router.post(ENDPOINT)
async def create_message(req: MessagesRequest, request: Request,
                         ctx: ServerContext = Depends(get_ctx)) -> Any:
    """Create a message (streaming with ``stream: true``)."""
    session = await _open(ctx, req, ENDPOINT)
    clamped = clamp_max_tokens(session, req.max_tokens)
    if req.stream:
        return StreamingResponse(leased_stream(_stream(session, req, clamped), session.close,
                                               _stream_error),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return await _respond(session, request, req, clamped)


@router.post(COUNT_ENDPOINT)
async def count_tokens(req: CountTokensRequest,
                       ctx: ServerContext = Depends(get_ctx)) -> dict[str, int]:
    """Tokens of the prompt as the model's chat template renders it; nothing is generated.
    A prompt longer than the context is counted too (Claude Code measures its history
    with this before it compacts)."""
    try:
        session = await _open(ctx, req, COUNT_ENDPOINT)
    except CountedOverflow as over:
        return {"input_tokens": over.tokens}
    try:
        return {"input_tokens": session.prompt_tokens}
    finally:
        await session.close()
