"""/v1/models: the OpenAI model list plus mlxd's state, and the admin routes."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mlxd.engines.base import ModelEngine
from mlxd.errors import Conflict, InvalidRequest, ModelNotFound
from mlxd.models.catalog import CatalogError, registration_for
from mlxd.models.manager import Registration
from mlxd.models.qualification import qualification_problem
from mlxd.models.residency import ResidencyManager, State
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute

router = APIRouter(route_class=StrictJSONRoute)


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    wait: StrictBool = True


def _iso(monotonic: float | None) -> str | None:
    if monotonic is None:
        return None
    wall = time.time() - (time.monotonic() - monotonic)
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat(timespec="seconds")


def model_card(ctx: ServerContext, res: ResidencyManager) -> dict[str, Any]:
    aliases = ctx.manager.aliases_of(res.name)
    card: dict[str, Any] = {
        "id": res.name, "object": "model", "created": int(ctx.started_at), "owned_by": "mlxd",
        "kind": str(res.kind), "state": str(res.state), "pinned": res.pinned,
        "memory_bytes": res.memory_bytes(), "estimated_bytes": res.estimate,
        "loads": res.loads, "last_used": _iso(res.last_used), "in_use": res.leases,
        "aliases": aliases, "source": res.entry.source,
    }
    refusal = ctx.manager.unservable(res.kind)
    card["servable"] = refusal is None
    if refusal is not None:
        card["unservable_reason"] = refusal
    fault = res.health()
    card["health"] = "failing" if fault or res.state == State.FAILED else "ok"
    if res.state == State.FAILED:
        card["error"] = res.last_error
    elif fault:
        card["error"] = fault
    engine: ModelEngine | None = res.engine
    if engine is not None and res.state == State.LOADED:
        try:
            card["measured_bytes"] = int(engine.memory_bytes())
            card.update(engine.facts().card)
        except Exception:
            pass
    if res.entry.qualification:
        card["qualification"] = res.entry.qualification.get("status")
    return card


def adapter_card(ctx: ServerContext, res: ResidencyManager, name: str) -> dict[str, Any]:
    """A LoRA adapter served over ``res``: a model name of its own, with its base
    (``parent``, as vLLM lists LoRA modules) and the base's state."""
    return {"id": name, "object": "model", "created": int(ctx.started_at), "owned_by": "mlxd",
            "kind": str(res.kind), "adapter": True, "parent": res.name,
            "root": res.entry.adapters[name], "state": str(res.state)}


@router.get("/v1/models")
async def list_models(ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Every registered model and LoRA adapter, and the kinds this install can serve
    (``servable_kinds``)."""
    data = []
    for r in ctx.manager.residencies():
        data.append(model_card(ctx, r))
        data.extend(adapter_card(ctx, r, a) for a in r.entry.adapters)
    return {"object": "list", "data": data,
            "servable_kinds": [str(k) for k in ModelKind if ctx.manager.unservable(k) is None]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    res = ctx.manager.get(name)
    if name in res.entry.adapters:
        return adapter_card(ctx, res, name)
    return model_card(ctx, res)


@router.post("/v1/models/load")
async def load_model(ref: ModelRef, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    res = await ctx.manager.load(ref.model)
    return model_card(ctx, res)


@router.post("/v1/models/unload")
async def unload_model(ref: ModelRef, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    unloaded = await ctx.manager.unload(ref.model, wait=ref.wait)
    card = model_card(ctx, ctx.manager.get(ref.model))
    card["unloaded"] = unloaded
    return card


def prepare_registration(entry: ModelEntry, ctx: ServerContext) -> Registration:
    """Detection, the memory estimate and the ``--require-qualified`` gate (the same as at
    startup). Blocking (file reads, sha256 of the model files): run in a worker thread."""
    try:
        reg = registration_for(entry, ctx.config, ctx.manager.policy.budget_bytes)
    except CatalogError as e:
        raise InvalidRequest(str(e), param="source") from None
    if ctx.config.require_qualified:
        problem = qualification_problem(entry, ctx.config.home, ctx.hasher)
        if problem:
            raise InvalidRequest(f"--require-qualified refuses '{entry.name}': {problem}",
                                 param="source", code="model_not_qualified")
    return reg


@router.put("/v1/models")
async def put_model(entry: ModelEntry, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Add (or replace, when not in use) a registry entry at run time."""
    # Never on the event loop: detection and hashing read files, the registry write fsyncs.
    ctx.manager.check_names(entry)  # before anything is replaced
    reg = await asyncio.to_thread(prepare_registration, entry, ctx)
    for adapter in entry.adapters:  # each adapter is a served name of its own
        try:
            owner = ctx.manager.resolve_name(adapter)
        except ModelNotFound:
            continue
        if owner != entry.name or adapter == entry.name:
            raise InvalidRequest(f"Adapter name '{adapter}' is already a served model name.",
                                 param="adapters")
    replaced = entry.name in ctx.manager.names
    if replaced:
        res = ctx.manager.get(entry.name)
        if res.leases:
            raise Conflict(f"Model '{entry.name}' is in use; retry later.", code="model_in_use")
        await ctx.manager.unregister(entry.name)
    ctx.manager.register(reg)
    for adapter in entry.adapters:
        ctx.manager.alias(adapter, entry.name)
    persisted = False
    if ctx.registry is not None:
        await asyncio.to_thread(ctx.registry.upsert, entry)
        persisted = True
    card = model_card(ctx, ctx.manager.get(entry.name))
    card.update(replaced=replaced, persisted=persisted)
    return card


@router.delete("/v1/models/{name:path}")
async def delete_model(name: str, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    res = ctx.manager.get(name)
    if name in res.entry.adapters:
        raise InvalidRequest(f"'{name}' is an adapter of model '{res.name}': PUT that entry "
                             "without it to remove it.", param="model")
    await ctx.manager.unregister(res.name)
    persisted = (await asyncio.to_thread(ctx.registry.remove, res.name)
                 if ctx.registry is not None else False)
    return {"id": res.name, "object": "model", "deleted": True, "persisted": persisted}
