"""GET /health: liveness plus a short summary (never needs an API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from mlxd.models.residency import State
from mlxd.server.context import ServerContext, get_ctx

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    residencies = ctx.manager.residencies()
    return {"status": "ok", "models": len(residencies),
            "loaded": [r.name for r in residencies if r.state == State.LOADED]}
