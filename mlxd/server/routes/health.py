"""GET /health: liveness plus a short summary (never needs an API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response

from mlxd.models.residency import ResidencyManager, State
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.drain import RETRY_AFTER_S

router = APIRouter()


@router.get("/health")
async def health(response: Response, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """``status`` is ``degraded`` while a loaded model is broken (``unhealthy`` says why).

    Still HTTP 200: the process answers and other models serve; a broken
    model recovers by unloading it (the next request loads it again). While
    shutting down it is ``draining`` with HTTP 503, so load balancers take the
    replica out while its in-flight requests finish (server/drain.py). A server
    sharded over a group (``--hosts``) whose group broke is ``unhealthy`` with 503.
    ``ready`` is true when a model is loaded and nothing is broken or draining;
    ``load`` counts running and queued sequences, for a router to balance on.
    """
    residencies = ctx.manager.residencies()
    unhealthy = {r.name: fault for r in residencies if (fault := r.health()) is not None}
    status = "degraded" if unhealthy else "ok"
    if unhealthy and ctx.config.hosts:
        # One sharded model is the whole server (--hosts): a broken group serves nothing.
        status = "unhealthy"
        response.status_code = 503
    if ctx.drain.draining:
        status = "draining"
        response.status_code = 503
        response.headers["Retry-After"] = str(round(RETRY_AFTER_S))
    loaded = [r for r in residencies if r.state == State.LOADED]
    return {"status": status, "models": len(residencies),
            "loaded": [r.name for r in loaded], "unhealthy": unhealthy,
            "ready": bool(loaded) and response.status_code in (None, 200) and not unhealthy,
            "load": _load(loaded)}


def _load(loaded: list[ResidencyManager]) -> dict[str, int]:
    """Sequences decoding and queued over the loaded models: what a router balances on."""
    stats = [s for res in loaded if (s := res.stats()) is not None]
    return {"running": sum(s.running for s in stats), "waiting": sum(s.waiting for s in stats)}
