"""POST /api/chat and /api/generate: Ollama's native API, a thin adapter.

Requests become a ``GenerationRequest`` (``ollama_input.py``) and go through the same
``TextSession`` and pipeline as the OpenAI and Anthropic routes; pipeline events become
Ollama's NDJSON lines (``stream``, true by default) or one JSON object:
``TextDelta`` -> ``content`` / ``response``, ``ReasoningDelta`` -> ``thinking``,
``ToolCall`` -> ``tool_calls`` (arguments as an object), ``Finish`` -> the closing line
with ``done_reason`` and the counts and durations (nanoseconds).

``num_predict`` is a cap, as ``max_tokens`` is on ``/v1/messages``: generation stops at
the end of the context (``done_reason: "length"``) if that comes first. An empty
``messages`` / ``prompt`` only loads the model (``done_reason: "load"``), or with
``keep_alive: 0`` unloads it (``"unload"``). The other ``/api/*`` routes live in
``ollama_models.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.engines.base import CHAT
from mlxd.errors import Conflict, GenerationFailed, InvalidRequest
from mlxd.generation.events import Event, Finish, ReasoningDelta, TextDelta, TokenLogprob, ToolCall
from mlxd.protocol.ollama import ChatRequest, ChatResponse, GenerateRequest, GenerateResponse
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.routes import ollama_models
from mlxd.server.routes.anthropic import tool_input
from mlxd.server.routes.ollama_input import (
    chat_request,
    generate_request,
    keep_alive_seconds,
    ndjson,
    resolve_name,
)
from mlxd.server.text_session import TextSession, finish_of

router = APIRouter(route_class=StrictJSONRoute)
router.include_router(ollama_models.router)
CHAT_ENDPOINT = "/api/chat"
GENERATE_ENDPOINT = "/api/generate"
NDJSON = "application/x-ndjson"


def created_at() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                             for t in lp.top]}


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": call.index, "name": call.name,
                                        "arguments": tool_input(call)}}


class Answer:
    """Events -> Ollama's chat (``message``) or generate (``response``) objects."""

    def __init__(self, model: str, chat: bool, logprobs: bool, started: float,
                 opened: float) -> None:
        self.model, self.chat, self.logprobs = model, chat, logprobs
        self.started, self.opened = started, opened
        self.first: float | None = None

    def _object(self, text: str, thinking: str, calls: list[ToolCall], done: bool,
                lps: list[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        tool_calls = [tool_call_json(c) for c in calls]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
            if tool_calls:
                out["tool_calls"] = tool_calls
        out["done"] = done
        if self.logprobs and lps:
            out["logprobs"] = [_logprob(lp) for lp in lps]
        return out

    def line(self, event: Event) -> dict[str, Any] | None:
        """The streamed line for one event (None: nothing to send)."""
        if self.first is None:
            self.first = time.monotonic()
        if isinstance(event, TextDelta) and (event.text or event.logprobs):
            return self._object(event.text, "", [], False, event.logprobs or [])
        if isinstance(event, ReasoningDelta) and event.text:
            return self._object("", event.text, [], False, [])
        if isinstance(event, ToolCall):
            return self._object("", "", [event], False, [])
        return None

    def closing(self, finish: Finish, events: list[Event] | None = None) -> dict[str, Any]:
        """The last line (``events``: the whole answer, when not streaming)."""
        if finish.reason == "error":
            raise GenerationFailed(finish.error or "generation failed")
        events = events or []
        out = self._object(
            "".join(e.text for e in events if isinstance(e, TextDelta)),
            "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            [e for e in events if isinstance(e, ToolCall)], True,
            [lp for e in events if isinstance(e, TextDelta) for lp in e.logprobs or []])
        now = time.monotonic()
        # not streamed: the first token's time is unknown; eval_duration includes the prompt's
        first = self.first or self.opened
        out["done_reason"] = "length" if finish.reason == "length" else "stop"
        out.update(total_duration=_ns(now - self.started), load_duration=_ns(self.opened -
                                                                             self.started),
                   prompt_eval_count=finish.usage.prompt_tokens,
                   prompt_eval_duration=_ns(first - self.opened),
                   eval_count=finish.usage.completion_tokens, eval_duration=_ns(now - first))
        return out


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


async def _after(ctx: ServerContext, name: str, keep_alive: float | None) -> None:
    """``keep_alive: 0``: unload now (the idle reaper does it if another request holds it)."""
    if keep_alive == 0:
        with contextlib.suppress(Conflict):
            await ctx.manager.unload(name, wait=False)


async def _load_only(ctx: ServerContext, req: ChatRequest | GenerateRequest, name: str,
                     keep_alive: float | None, endpoint: str, chat: bool) -> JSONResponse:
    """An empty conversation: load the model, or unload it with ``keep_alive: 0``."""
    ctx.manager.check_kind(name, CHAT, endpoint)
    if keep_alive == 0:
        await _after(ctx, name, keep_alive)
        reason = "unload"
    else:
        async with ctx.manager.lease(name, CHAT, endpoint):
            ctx.manager.get(name).keep_alive = keep_alive
        reason = "load"
    out: dict[str, Any] = {"model": req.model, "created_at": created_at()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason=reason)
    return JSONResponse(out)


def _stream_error(error: StreamError) -> str:
    return ndjson({"error": error.message})


async def _stream(session: TextSession, answer: Answer) -> AsyncIterator[str]:
    async for _, event in session.events():
        if not isinstance(event, Finish):
            line = answer.line(event)
            if line is not None:
                yield ndjson(line)
        elif event.reason == "error":
            yield ndjson({"error": event.error or "generation failed"})
        else:
            yield ndjson(answer.closing(event))


async def _respond(ctx: ServerContext, session: TextSession, request: Request, answer: Answer,
                   keep_alive: float | None) -> JSONResponse:
    try:
        events = (await session.collect(request))[0]
    finally:
        await session.close()
        await _after(ctx, session.model_name, keep_alive)
    return JSONResponse(answer.closing(finish_of(events), events))


async def _generate(ctx: ServerContext, req: ChatRequest | GenerateRequest, request: Request,
                    endpoint: str) -> Any:
    started = time.monotonic()
    keep_alive = keep_alive_seconds(req.keep_alive)
    name = resolve_name(ctx, req.model)
    chat = isinstance(req, ChatRequest)
    if not (req.messages if isinstance(req, ChatRequest) else req.prompt):
        return await _load_only(ctx, req, name, keep_alive, endpoint, chat)
    gen = chat_request(req) if isinstance(req, ChatRequest) else generate_request(req)
    session = await TextSession.open(ctx, name, gen, endpoint=endpoint)
    try:
        if req.think and not session.engine.facts().reasoning_parser:
            raise InvalidRequest(f"\"{req.model}\" does not support thinking.", param="think")
        ctx.manager.get(name).keep_alive = keep_alive
    except BaseException:
        await session.close()
        raise
    answer = Answer(req.model, chat, req.logprobs, started, time.monotonic())
    if req.stream:
        async def release() -> None:
            await session.close()
            await _after(ctx, session.model_name, keep_alive)

        return StreamingResponse(leased_stream(_stream(session, answer), release, _stream_error),
                                 media_type=NDJSON)
    return await _respond(ctx, session, request, answer, keep_alive)


@router.post(CHAT_ENDPOINT, response_model=ChatResponse)
async def chat(req: ChatRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Any:
    """The next chat message (NDJSON lines unless ``stream: false``)."""
    return await _generate(ctx, req, request, CHAT_ENDPOINT)


@router.post(GENERATE_ENDPOINT, response_model=GenerateResponse)
async def generate(req: GenerateRequest, request: Request,
                   ctx: ServerContext = Depends(get_ctx)) -> Any:
    """A completion of ``prompt`` (NDJSON lines unless ``stream: false``)."""
    return await _generate(ctx, req, request, GENERATE_ENDPOINT)
