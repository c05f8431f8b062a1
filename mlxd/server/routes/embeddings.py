"""POST /v1/embeddings: the OpenAI Embeddings adapter.

Checks the model's kind and the inputs (count, emptiness, token ids) before
anything loads; the model's lease is held until the vectors are computed.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from mlxd.engines.base import EMBEDDING
from mlxd.errors import InvalidRequest
from mlxd.protocol.embeddings import EmbeddingRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.disconnect import unless_disconnected
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.observe import count_input_tokens

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/embeddings"
_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_list(value: list[Any], where: str) -> list[int]:
    if not value:
        raise InvalidRequest(f"{where} is an empty token list.", param="input")
    # By position, not value: a bad item may itself be None.
    bad = next((i for i, v in enumerate(value) if not _is_token_id(v) or v < 0), None)
    if bad is not None:
        raise InvalidRequest(f"{where}[{bad}] is {value[bad]!r}; token ids are non-negative "
                             "integers.", param="input")
    return list(value)


def embedding_inputs(raw: str | list[Any], max_inputs: int) -> list[str | list[int]]:
    """Normalise OpenAI's four ``input`` shapes into a list of texts / token lists (or 400)."""
    single = isinstance(raw, str) or (bool(raw) and all(_is_token_id(v) for v in raw))
    items: list[Any] = [raw] if single else list(raw)
    if not items:
        raise InvalidRequest("input must not be empty.", param="input")
    if len(items) > max_inputs:
        raise InvalidRequest(f"input has {len(items)} items; this server accepts at most "
                             f"{max_inputs} per request (--max-embedding-inputs).", param="input")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        where = "input" if single else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{where} is an empty string.", param="input")
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_list(item, where))
        else:
            raise InvalidRequest(f"{where} is {type(item).__name__}; input must be {_SHAPES}.",
                                 param="input")
    return out


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A float list, or base64 of little-endian float32 bytes (what OpenAI's SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


@router.post(ENDPOINT)
async def create_embeddings(req: EmbeddingRequest, request: Request,
                            ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    """Embed ``input`` with an embedding model (OpenAI response shape); a client that
    leaves first takes its rows that have not run out of the batch queue."""
    ctx.manager.check_kind(req.model, EMBEDDING, ENDPOINT)
    inputs = embedding_inputs(req.input, ctx.config.max_embedding_inputs)
    async with ctx.manager.lease(req.model, EMBEDDING, ENDPOINT) as lease:
        engine = lease.engine
        engine.check_dimensions(req.dimensions)
        encoded = await engine.encode(inputs)
        vectors = await unless_disconnected(request, engine.embed(encoded, req.dimensions))
    tokens = sum(len(e) for e in encoded)
    count_input_tokens(tokens)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": req.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
