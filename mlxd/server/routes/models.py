"""/v1/models: the OpenAI model list plus mlxd's state, and the admin routes."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mlxd.errors import Conflict, InvalidRequest, ModelNotFound
from mlxd.models.catalog import CatalogError, registration_for
from mlxd.models.live_adapters import adapter_base, add_adapter, remove_adapter
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
    # load only: serve the LoRA adapter in folder ``adapter_path`` as ``model`` over ``base``
    base: str | None = Field(default=None, min_length=1)
    adapter_path: str | None = Field(default=None, min_length=1)


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
    facts = res.facts()
    if facts is not None:  # loaded: what it holds now and what it is
        measured = res.live_bytes()
        if measured is not None:
            card["measured_bytes"] = measured
        card.update(facts.card)
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
        data.extend(adapter_card(ctx, r, a) for a in r.entry.adapters
                    if a not in r.removing_adapters)  # a removed name is a 404 already
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
    """Load a model; with ``base`` and ``adapter_path``, add a LoRA adapter named ``model``
    over the registered ``base`` (its running requests go on untouched)."""
    if (ref.base is None) != (ref.adapter_path is None):
        raise InvalidRequest("A LoRA adapter needs both base (the model it adapts) and "
                             "adapter_path (its mlx-lm adapter folder).",
                             param="base" if ref.base is None else "adapter_path")
    if ref.base is not None and ref.adapter_path is not None:
        res = await add_adapter(ctx.manager, ctx.config, ref.base, ref.model, ref.adapter_path)
        return {**adapter_card(ctx, res, ref.model), "loaded": True}
    res = await ctx.manager.load(ref.model)
    return model_card(ctx, res)


@router.post("/v1/models/unload")
async def unload_model(ref: ModelRef, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Unload a model; for a LoRA adapter's name, stop serving the adapter (with ``wait``,
    after the requests that use it finish) and leave its base as it is."""
    if ref.base is not None or ref.adapter_path is not None:
        raise InvalidRequest("base and adapter_path are for /v1/models/load.",
                             param="base" if ref.base is not None else "adapter_path")
    base = adapter_base(ctx.manager, ref.model)
    if base is not None:
        card = adapter_card(ctx, base, ref.model)
        await remove_adapter(ctx.manager, ref.model, wait=ref.wait)
        return {**card, "unloaded": True, "removed": True}
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
    if replaced and only_adapters_differ(ctx.manager.get(entry.name).entry, reg.entry):
        # the base keeps serving: its adapters are added and removed as they run
        await swap_adapters(ctx, entry.name, reg.entry.adapters)
        persisted = False
        if ctx.registry is not None:
            await asyncio.to_thread(ctx.registry.upsert, entry)
            persisted = True
        card = model_card(ctx, ctx.manager.get(entry.name))
        card.update(replaced=False, adapters_changed=True, persisted=persisted)
        return card
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


def _folder(path: str) -> Path:
    return Path(path).expanduser().absolute()


def only_adapters_differ(old: ModelEntry, new: ModelEntry) -> bool:
    """Whether a PUT of ``new`` over ``old`` changes nothing but the LoRA adapters."""
    def without(e: ModelEntry) -> ModelEntry:
        return e.model_copy(update={"adapters": {}})
    return without(old) == without(new) and \
        {n: _folder(f) for n, f in old.adapters.items()} != \
        {n: _folder(f) for n, f in new.adapters.items()}


async def swap_adapters(ctx: ServerContext, base: str, adapters: dict[str, str]) -> None:
    """Remove the adapters ``base`` serves that ``adapters`` drops or moves (after their
    requests finish), then add the new ones."""
    old = ctx.manager.get(base).entry.adapters
    for name, folder in old.items():
        if name not in adapters or _folder(adapters[name]) != _folder(folder):
            await remove_adapter(ctx.manager, name)
    for name, folder in adapters.items():
        if name not in old or _folder(old[name]) != _folder(folder):
            await add_adapter(ctx.manager, ctx.config, base, name, folder)


@router.delete("/v1/models/{name:path}")
async def delete_model(name: str, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    res = ctx.manager.get(name)
    if name in res.entry.adapters:
        raise InvalidRequest(f"'{name}' is an adapter of model '{res.name}': unload it "
                             "(POST /v1/models/unload) or PUT that entry without it.",
                             param="model")
    await ctx.manager.unregister(res.name)
    persisted = (await asyncio.to_thread(ctx.registry.remove, res.name)
                 if ctx.registry is not None else False)
    return {"id": res.name, "object": "model", "deleted": True, "persisted": persisted}
