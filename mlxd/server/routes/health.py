"""GET /health: liveness plus a short summary (never needs an API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from mlxd.models.residency import State
from mlxd.server.context import ServerContext, get_ctx

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """``status`` is ``degraded`` while a loaded model is broken (``unhealthy`` says why).

    Still HTTP 200: the process answers and other models serve; a broken
    model recovers by unloading it (the next request loads it again).
    """
    residencies = ctx.manager.residencies()
    unhealthy = {r.name: fault for r in residencies if (fault := r.health()) is not None}
    return {"status": "degraded" if unhealthy else "ok", "models": len(residencies),
            "loaded": [r.name for r in residencies if r.state == State.LOADED],
            "unhealthy": unhealthy}
