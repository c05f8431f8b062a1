"""POST /v1/chat/completions: the OpenAI Chat Completions adapter."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.errors import GenerationFailed, InvalidRequest
from mlxd.generation.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
)
from mlxd.generation.params import GenerationRequest
from mlxd.protocol.openai import ChatCompletionRequest
from mlxd.protocol.tokenize import TokenizeRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.openai_tools import constraint, tool_choice, tool_specs
from mlxd.server.request_policy import pick, sampling_choices, stop_list
from mlxd.server.sse import SSE_COMMENT_KEEPALIVE, SSE_DONE, SSE_HEADERS, sse_data
from mlxd.server.text_session import (
    TextSession,
    finish_of,
    merge_usage,
    usage_openai,
)

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/chat/completions"


def canonical_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    if not req.messages:
        raise InvalidRequest("messages must contain at least one message.", param="messages")
    out = []
    for m in req.messages:
        msg = m.model_dump(exclude_none=True)
        if msg["role"] == "developer":
            msg["role"] = "system"
        elif msg["role"] == "function":
            msg["role"] = "tool"
        out.append(msg)
    return out


def generation_request(req: ChatCompletionRequest) -> GenerationRequest:
    """The client's request; ``TextSession.open`` fills in the model's defaults."""
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    tools = tool_specs(req.tools)
    return GenerationRequest(
        messages=canonical_messages(req),
        sampling_choices=sampling_choices(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.logit_bias),
        max_tokens=pick(req.max_completion_tokens, req.max_tokens),
        stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
        tools=tools, tool_choice=tool_choice(req.tool_choice, tools),
        constraint=constraint(req.response_format, regex=req.regex, grammar=req.grammar,
                              guided_json=req.guided_json),
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        cache_salt=req.cache_salt,
    )


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                             for t in lp.top]}


def tool_call_json(tc: ToolCall, streaming: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": tc.id, "type": "function",
                           "function": {"name": tc.name, "arguments": tc.arguments}}
    if streaming:
        out["index"] = tc.index
    return out


def finish_reason(finish: Finish) -> str:
    if finish.reason == "error":
        raise GenerationFailed(finish.error or "generation failed")
    return {"cancelled": "stop"}.get(finish.reason, finish.reason)


def choice_message(index: int, events: list[Event], want_logprobs: bool) -> dict[str, Any]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [tool_call_json(e) for e in events if isinstance(e, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if want_logprobs:
        logprobs = {"content": [logprob_entry(lp) for e in events if isinstance(e, TextDelta)
                                for lp in e.logprobs or []]}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(finish_of(events))}


def _fingerprint() -> str:
    from mlxd import __version__

    return f"mlxd-{__version__}"


async def _respond(session: TextSession, request: Request, req: ChatCompletionRequest) -> JSONResponse:
    try:
        per_choice = await session.collect(request)
    finally:
        await session.close()
    choices = [choice_message(i, evs, req.logprobs) for i, evs in sorted(per_choice.items())]
    usage = merge_usage(finish_of(evs).usage for evs in per_choice.values())
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": req.model, "system_fingerprint": _fingerprint(),
        "choices": choices, "usage": usage_openai(usage)})


async def _stream(session: TextSession, req: ChatCompletionRequest) -> AsyncIterator[str]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None) -> str:
        return sse_data({"id": cid, "object": "chat.completion.chunk", "created": created,
                         "model": req.model, "system_fingerprint": _fingerprint(),
                         "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}]})

    usages = []
    for i in range(session.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for item in session.stream():
        if item is None:
            yield SSE_COMMENT_KEEPALIVE
            continue
        index, ev = item
        if isinstance(ev, TextDelta):
            lps = ({"content": [logprob_entry(lp) for lp in ev.logprobs]}
                   if req.logprobs and ev.logprobs else None)
            if ev.text or lps:
                yield chunk(index, {"content": ev.text}, logprobs=lps)
        elif isinstance(ev, ReasoningDelta):
            yield chunk(index, {"reasoning_content": ev.text, "reasoning": ev.text})
        elif isinstance(ev, ToolCall):
            yield chunk(index, {"tool_calls": [tool_call_json(ev, streaming=True)]})
        elif isinstance(ev, Finish):
            usages.append(ev.usage)
            if ev.reason == "error":
                yield sse_data({"error": {"message": ev.error or "generation failed",
                                          "type": "server_error", "param": None,
                                          "code": "generation_failed"}})
                return
            yield chunk(index, {}, finish_reason(ev))
    if include_usage:
        yield sse_data({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": req.model, "choices": [],
                        "usage": usage_openai(merge_usage(usages))})
    yield SSE_DONE


def stream_error(error: StreamError) -> str:
    """An OpenAI stream's error chunk (chat and completions), as for a failed generation."""
    return sse_data({"error": {"message": error.message, "type": error.type,
                               "param": error.param, "code": error.code or "generation_failed"}})


@router.post(ENDPOINT)
async def chat_completions(req: ChatCompletionRequest, request: Request,
                           ctx: ServerContext = Depends(get_ctx)) -> Any:
    gen = generation_request(req)
    session = await TextSession.open(ctx, req.model, gen, n=req.n, endpoint=ENDPOINT)
    if req.stream:
        return StreamingResponse(leased_stream(_stream(session, req), session.close, stream_error),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return await _respond(session, request, req)
