"""POST /v1/completions: the OpenAI (legacy) Completions adapter."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.engines.base import COMPLETION
from mlxd.errors import InvalidRequest
from mlxd.generation.events import Finish, TextDelta, TokenLogprob
from mlxd.generation.params import GenerationRequest
from mlxd.protocol.openai import CompletionRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import leased_stream
from mlxd.server.openai_tools import constraint
from mlxd.server.request_policy import sampling_choices, stop_list
from mlxd.server.routes.chat import finish_reason, stream_error
from mlxd.server.sse import SSE_COMMENT_KEEPALIVE, SSE_DONE, SSE_HEADERS, sse_data
from mlxd.server.text_session import (
    TextSession,
    finish_of,
    merge_usage,
    usage_openai,
)

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/completions"


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists.", param="prompt")


def generation_request(req: CompletionRequest, prompt: str | list[int]) -> GenerationRequest:
    """The client's request for one prompt; ``TextSession.open`` fills in the defaults."""
    if isinstance(prompt, str) and not prompt:
        raise InvalidRequest("prompt must not be empty.", param="prompt")
    return GenerationRequest(
        prompt=prompt,
        sampling_choices=sampling_choices(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.logit_bias),
        max_tokens=req.max_tokens,
        stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
        constraint=constraint(req.response_format, regex=req.regex, grammar=req.grammar,
                              guided_json=req.guided_json),
        cache_salt=req.cache_salt)


def legacy_logprobs(entries: list[TokenLogprob | None], offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for lp in entries:
        if lp is None:
            continue
        tokens.append(lp.token)
        token_lps.append(lp.logprob)
        tops.append({t.token: t.logprob for t in lp.top} if lp.top else None)
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


async def _echo_logprobs(session: TextSession, top: int) -> list[TokenLogprob]:
    """Prompt-token logprobs for ``echo`` (the first token has none)."""
    return await session.engine.prompt_logprobs(session.prepared, top)


async def _open_all(ctx: ServerContext, req: CompletionRequest) -> list[TextSession]:
    if req.suffix:
        raise InvalidRequest("suffix is not supported.", param="suffix")
    sessions: list[TextSession] = []
    try:
        for prompt in prompts_of(req.prompt):
            gen = generation_request(req, prompt)
            sessions.append(await TextSession.open(ctx, req.model, gen, n=req.n,
                                                   endpoint=ENDPOINT, family=COMPLETION))
    except BaseException:
        for s in sessions:
            await s.close()
        raise
    return sessions


async def _respond(sessions: list[TextSession], request: Request,
                   req: CompletionRequest) -> JSONResponse:
    choices, usages = [], []
    try:
        results = await asyncio.gather(*(s.collect(request) for s in sessions))
        for p, (session, per_choice) in enumerate(zip(sessions, results)):
            echo_text = session.engine.prompt_text(session.prepared) if req.echo else ""
            echo_lps: list[TokenLogprob] = []
            if req.echo and req.logprobs is not None:
                echo_lps = await _echo_logprobs(session, req.logprobs)
            for i, events in sorted(per_choice.items()):
                text = "".join(e.text for e in events if isinstance(e, TextDelta))
                lps = None
                if req.logprobs is not None:
                    gen_lps = [lp for e in events if isinstance(e, TextDelta)
                               for lp in e.logprobs or []]
                    lps = legacy_logprobs([*echo_lps, *gen_lps], 0)
                    if echo_lps:
                        lps["token_logprobs"][0] = None
                finish = finish_of(events)
                choices.append({"index": p * req.n + i, "text": echo_text + text,
                                "logprobs": lps, "finish_reason": finish_reason(finish)})
                usages.append(finish.usage)
    finally:
        for s in sessions:
            await s.close()
    prompt_tokens = sum(s.prompt_tokens for s in sessions)
    usage = usage_openai(merge_usage(usages))
    usage["prompt_tokens"] = prompt_tokens
    usage["total_tokens"] = prompt_tokens + usage["completion_tokens"]
    return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                         "created": int(time.time()), "model": req.model, "choices": choices,
                         "usage": usage})


async def _stream(sessions: list[TextSession], req: CompletionRequest) -> AsyncIterator[str]:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, text: str, finish: str | None = None, lps: Any = None) -> str:
        return sse_data({"id": cid, "object": "text_completion", "created": created,
                         "model": req.model, "choices": [{"index": index, "text": text,
                                                          "logprobs": lps,
                                                          "finish_reason": finish}]})

    usages = []
    for p, session in enumerate(sessions):
        if req.echo:
            for i in range(session.n):
                yield chunk(p * req.n + i, session.engine.prompt_text(session.prepared))
        async for item in session.stream():
            if item is None:
                yield SSE_COMMENT_KEEPALIVE
                continue
            i, ev = item
            index = p * req.n + i
            if isinstance(ev, TextDelta):
                lps = (legacy_logprobs(list(ev.logprobs), 0)
                       if req.logprobs is not None and ev.logprobs else None)
                if ev.text or lps:
                    yield chunk(index, ev.text, lps=lps)
            elif isinstance(ev, Finish):
                usages.append(ev.usage)
                if ev.reason == "error":
                    yield sse_data({"error": {"message": ev.error or "generation failed",
                                              "type": "server_error", "param": None,
                                              "code": "generation_failed"}})
                    return
                yield chunk(index, "", finish_reason(ev))
    if include_usage:
        usage = usage_openai(merge_usage(usages))
        usage["prompt_tokens"] = sum(s.prompt_tokens for s in sessions)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        yield sse_data({"id": cid, "object": "text_completion", "created": created,
                        "model": req.model, "choices": [], "usage": usage})
    yield SSE_DONE


@router.post(ENDPOINT)
async def completions(req: CompletionRequest, request: Request,
                      ctx: ServerContext = Depends(get_ctx)) -> Any:
    ctx.manager.check_kind(req.model, COMPLETION, ENDPOINT)
    sessions = await _open_all(ctx, req)
    if req.stream:
        async def close_all() -> None:
            for s in sessions:
                await s.close()

        return StreamingResponse(leased_stream(_stream(sessions, req), close_all, stream_error),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return await _respond(sessions, request, req)
