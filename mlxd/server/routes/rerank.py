"""POST /v1/rerank (also /rerank and /v2/rerank): the Cohere / Jina rerank adapter.

The model's kind, the query and the document count are checked before a
model loads; the pairs' total token count is checked after tokenising and
before any forward pass. Results come sorted by ``relevance_score`` (ties
keep input order) with each document's original ``index``.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from mlxd.engines.base import RERANK
from mlxd.errors import InvalidRequest
from mlxd.protocol.rerank import RerankRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.disconnect import unless_disconnected
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.observe import count_input_tokens

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINTS = ("/v1/rerank", "/rerank", "/v2/rerank")


def document_texts(req: RerankRequest, max_documents: int) -> list[str]:
    """The documents' texts, after the request-shape checks (400s)."""
    if not req.query.strip():
        raise InvalidRequest("query must not be empty.", param="query")
    if not req.documents:
        raise InvalidRequest("documents must not be empty.", param="documents")
    if len(req.documents) > max_documents:
        raise InvalidRequest(f"documents has {len(req.documents)} items; this server accepts at "
                             f"most {max_documents} per request (--max-rerank-documents).",
                             param="documents")
    return [d if isinstance(d, str) else d.text for d in req.documents]


def ranked_results(scores: list[float], texts: list[str], top_n: int | None,
                   return_documents: bool) -> list[dict[str, Any]]:
    """Results best first (ties in input order), cut to ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    results = []
    for i in order[: top_n or len(order)]:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return results


async def _rerank(req: RerankRequest, request: Request, ctx: ServerContext) -> JSONResponse:
    endpoint = request.url.path
    ctx.manager.check_kind(req.model, RERANK, endpoint)
    texts = document_texts(req, ctx.config.max_rerank_documents)
    async with ctx.manager.lease(req.model, RERANK, endpoint) as lease:
        engine = lease.engine
        encoded = await engine.encode(req.query, texts)
        tokens = sum(len(e) for e in encoded)
        if tokens > ctx.config.max_rerank_tokens:
            raise InvalidRequest(
                f"The query-document pairs are {tokens} tokens; this server accepts at most "
                f"{ctx.config.max_rerank_tokens} per request (--max-rerank-tokens).",
                param="documents", code="too_many_tokens")
        # a client that leaves first takes its pairs that have not run out of the queue
        scores = [float(s) for s in await unless_disconnected(request, engine.score(encoded))]
    count_input_tokens(tokens)
    return JSONResponse({
        "id": f"rerank-{uuid.uuid4().hex}", "model": req.model,
        "results": ranked_results(scores, texts, req.top_n, req.return_documents),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}})


@router.post(ENDPOINTS[0])
@router.post(ENDPOINTS[1])
@router.post(ENDPOINTS[2])
async def rerank(req: RerankRequest, request: Request,
                 ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    """Score ``documents`` against ``query`` with a cross-encoder (Cohere / Jina shape)."""
    return await _rerank(req, request, ctx)
