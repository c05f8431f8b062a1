"""POST /api/embed and /api/embeddings: Ollama's embedding routes.

The same checks and engine calls as ``/v1/embeddings``. ``truncate`` follows the
server's ``--embedding-overflow`` policy (inputs over the model's length are cut, or
refused with a 400 under ``error``); ``options`` are accepted and ignored.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends

from mlxd.engines.base import EMBEDDING
from mlxd.errors import Conflict, InvalidRequest
from mlxd.protocol.ollama import EmbeddingsRequest, EmbeddingsResponse, EmbedRequest, EmbedResponse
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.observe import count_input_tokens
from mlxd.server.routes.embeddings import embedding_inputs
from mlxd.server.routes.ollama_input import keep_alive_seconds, resolve_name

router = APIRouter(route_class=StrictJSONRoute)
EMBED_ENDPOINT = "/api/embed"
EMBEDDINGS_ENDPOINT = "/api/embeddings"


async def _embed(ctx: ServerContext, model: str, inputs: list[str | list[int]],
                 dimensions: int | None, keep_alive: Any, endpoint: str
                 ) -> tuple[np.ndarray, int, float]:
    """(vectors, input tokens, seconds to lease the model)."""
    seconds = keep_alive_seconds(keep_alive)
    name = resolve_name(ctx, model)
    ctx.manager.check_kind(name, EMBEDDING, endpoint)
    started = time.monotonic()
    async with ctx.manager.lease(name, EMBEDDING, endpoint) as lease:
        leased = time.monotonic() - started
        lease.residency.keep_alive = seconds
        engine = lease.engine
        engine.check_dimensions(dimensions)
        encoded = await engine.encode(inputs)
        vectors = await engine.embed(encoded, dimensions)
    if seconds == 0:
        with contextlib.suppress(Conflict):  # in use: the idle reaper unloads it
            await ctx.manager.unload(name, wait=False)
    tokens = sum(len(e) for e in encoded)
    count_input_tokens(tokens)
    return vectors, tokens, leased


def _texts(raw: str | list[Any], max_inputs: int) -> list[str | list[int]]:
    """Ollama's ``input``: a string or a list of strings (token ids are OpenAI's, not Ollama's)."""
    if isinstance(raw, list) and any(not isinstance(item, str) for item in raw):
        bad = next(i for i, item in enumerate(raw) if not isinstance(item, str))
        raise InvalidRequest(f"input[{bad}] is {type(raw[bad]).__name__}; input must be a "
                             "string or a list of strings.", param="input")
    return embedding_inputs(raw, max_inputs)


@router.post(EMBED_ENDPOINT, response_model=EmbedResponse)
async def embed(req: EmbedRequest, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Embeddings of ``input`` (one string or several)."""
    started = time.monotonic()
    inputs = _texts(req.input, ctx.config.max_embedding_inputs)
    vectors, tokens, leased = await _embed(ctx, req.model, inputs, req.dimensions,
                                           req.keep_alive, EMBED_ENDPOINT)
    return {"model": req.model, "embeddings": [[float(x) for x in v] for v in vectors],
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int(leased * 1e9), "prompt_eval_count": tokens}


@router.post(EMBEDDINGS_ENDPOINT, response_model=EmbeddingsResponse)
async def embeddings(req: EmbeddingsRequest,
                     ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """The embedding of one ``prompt`` (Ollama's older route); an empty prompt loads the model."""
    if not req.prompt:
        name = resolve_name(ctx, req.model)
        async with ctx.manager.lease(name, EMBEDDING, EMBEDDINGS_ENDPOINT) as lease:
            lease.residency.keep_alive = keep_alive_seconds(req.keep_alive)
        return {"embedding": []}
    inputs = _texts(req.prompt, ctx.config.max_embedding_inputs)
    vectors, _, _ = await _embed(ctx, req.model, inputs, None, req.keep_alive,
                                 EMBEDDINGS_ENDPOINT)
    return {"embedding": [float(x) for x in vectors[0]]}
