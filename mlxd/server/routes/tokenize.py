"""POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's token endpoints.

lm-evaluation-harness (``local-completions``) probes ``/tokenizer_info`` and
``/tokenize`` at the server's root and, when both answer, uses the server's
tokenizer instead of downloading one named after the model; token-counting
clients use the same endpoints. They sit at the root as in vLLM, and take no
``model`` as a vLLM server has one: the server's ``default`` model (``mlxd
serve MODEL``, or the first chat model registered) answers then.

Chat messages are rendered exactly as ``/v1/chat/completions`` renders them,
so ``count`` equals the ``prompt_tokens`` a chat completion reports.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from mlxd.engines.base import CHAT
from mlxd.errors import InvalidRequest, ModelNotFound
from mlxd.generation.params import GenerationRequest
from mlxd.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.openai_tools import tool_choice, tool_specs
from mlxd.server.request_policy import apply_serving_defaults
from mlxd.server.routes.chat import canonical_messages
from mlxd.server.text_session import hold_media_memory, resolve_request_media

router = APIRouter(route_class=StrictJSONRoute)
TOKENIZE, DETOKENIZE, TOKENIZER_INFO = "/tokenize", "/detokenize", "/tokenizer_info"
DEFAULT_MODEL = "default"  # the catalog's alias for the served (or first chat) model


def model_name(ctx: ServerContext, model: str | None, endpoint: str) -> str:
    """``model``, or the default model when the client names none (as vLLM allows);
    checked for a text model before anything loads."""
    if model is None:
        try:
            model = ctx.manager.resolve_name(DEFAULT_MODEL)
        except ModelNotFound:
            raise InvalidRequest("model is required: this server has no default model. "
                                 f"Served: {', '.join(sorted(ctx.manager.names))}.",
                                 param="model") from None
    ctx.manager.check_kind(model, CHAT, endpoint)
    return model


def tokenize_request(req: TokenizeRequest) -> GenerationRequest:
    """What ``prepare`` would render: messages, tools and template options as the chat
    route builds them (the registry entry's template kwargs are added under the lease,
    as for a chat), or the prompt."""
    if req.prompt is not None:
        return GenerationRequest(prompt=req.prompt)
    tools = tool_specs(req.tools)
    return GenerationRequest(
        messages=canonical_messages(req), tools=tools, tool_choice=tool_choice(None, tools),
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message)


@router.post(TOKENIZE, response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(req: TokenizeRequest,
                   ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """A prompt's or chat's token ids and count, and the model's context length."""
    model = model_name(ctx, req.model, TOKENIZE)
    gen = tokenize_request(req)
    # A vision model's images are fetched and checked against the media limits before
    # the lease, as for a chat; its processor then counts their tokens.
    await resolve_request_media(ctx, model, gen, CHAT, TOKENIZE)
    special = req.add_special_tokens
    if special is None:  # vLLM's defaults: the chat template adds a chat's special tokens
        special = req.prompt is not None
    media = await hold_media_memory(ctx, gen)  # what decoding them holds, in the budget
    try:
        async with ctx.manager.lease(model, CHAT, TOKENIZE) as lease:
            apply_serving_defaults(gen, lease.entry.defaults, ctx.config)
            out = await lease.engine.tokenize(gen, add_special_tokens=special,
                                              token_strs=bool(req.return_token_strs))
    finally:
        if media is not None:
            await media.release()
    return {"count": len(out.tokens), "max_model_len": out.max_model_len,
            "tokens": out.tokens, "token_strs": out.token_strs}


@router.post(DETOKENIZE, response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest,
                     ctx: ServerContext = Depends(get_ctx)) -> dict[str, str]:
    """Token ids (each in the model's vocabulary) back to text."""
    model = model_name(ctx, req.model, DETOKENIZE)
    async with ctx.manager.lease(model, CHAT, DETOKENIZE) as lease:
        return {"prompt": await lease.engine.decode(req.tokens)}


@router.get(TOKENIZER_INFO, response_model=TokenizerInfoResponse)
async def tokenizer_info(model: str | None = None,
                         ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """The tokenizer's special tokens, context length and chat template (``?model=``:
    another model than the default)."""
    name = model_name(ctx, model, TOKENIZER_INFO)
    async with ctx.manager.lease(name, CHAT, TOKENIZER_INFO) as lease:
        return lease.engine.tokenizer_info()
