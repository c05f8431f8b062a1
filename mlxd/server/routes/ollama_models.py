"""Ollama's model routes: ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``,
``/api/delete``; ``/api/pull`` and the embedding routes are included from their modules.

Ollama's API serves chat, vision and embedding models, so those are the kinds listed.
``digest`` is the registry entry's ``sha256`` when it records one, else the sha256 of
its source string (an identifier, not a hash of the weights). ``size`` is the memory
the model holds (measured when loaded, estimated when not).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from mlxd import __version__
from mlxd.engines.base import CHAT
from mlxd.errors import InvalidRequest
from mlxd.models.catalog import CatalogError, local_path_of
from mlxd.models.memory import read_config
from mlxd.models.residency import ResidencyManager, State
from mlxd.models.spec import ModelKind
from mlxd.protocol.ollama import (
    ListResponse,
    ModelDetails,
    ModelRequest,
    ProcessResponse,
    ShowResponse,
    VersionResponse,
)
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.routes import ollama_embed, ollama_pull
from mlxd.server.routes.ollama_input import resolve_name

router = APIRouter(route_class=StrictJSONRoute)
router.include_router(ollama_embed.router)
router.include_router(ollama_pull.router)

# The Ollama release whose API (docs/api.md, api/types.go) these routes follow; clients
# gate features on it. mlxd's own version is in "mlxd_version".
OLLAMA_API_VERSION = "0.32.15"
OLLAMA_KINDS = (ModelKind.TEXT, ModelKind.VISION, ModelKind.EMBEDDING)
NEVER = "9999-12-31T23:59:59Z"  # expires_at of a model that is never unloaded for idleness
MAX_TTL_S = 100 * 365 * 86400.0


def iso(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def capabilities(res: ResidencyManager) -> list[str]:
    if res.kind is ModelKind.EMBEDDING:
        return ["embedding"]
    caps = ["completion", "tools"]
    facts = res.facts()
    if res.entry.reasoning_parser or (facts is not None and facts.reasoning_parser):
        caps.append("thinking")
    if res.kind is ModelKind.VISION:
        caps.append("vision")
    return caps


def _context_length(res: ResidencyManager) -> int | None:
    """The loaded model's context length (None when not loaded)."""
    facts = res.facts()
    return facts.context_length if facts is not None else None


def digest(res: ResidencyManager) -> str:
    return res.entry.sha256 or hashlib.sha256(res.entry.source.encode()).hexdigest()


def details(res: ResidencyManager, info: dict[str, Any] | None = None) -> ModelDetails:
    arch = str((info or {}).get("general.architecture") or "")
    source = res.entry.source.split("#")[-1].lower()
    return ModelDetails(format="gguf" if source.endswith(".gguf") else "safetensors",
                        family=arch, families=[arch] if arch else None)


def model_info(res: ResidencyManager, home: Path) -> dict[str, Any]:
    """Ollama's ``model_info`` keys from the model's files (GGUF metadata or config.json).

    Blocking (reads files): run it in a worker thread.
    """
    try:
        path = local_path_of(res.entry, home)
    except CatalogError:
        return {}
    info: dict[str, Any] = {}
    if path is not None:
        gguf = path if path.suffix == ".gguf" else next(iter(sorted(path.glob("*.gguf"))), None) \
            if path.is_dir() else None
        if gguf is not None:
            from mlxd.sources.gguf_header import GGUFHeaderError, read_gguf_header

            try:
                header = read_gguf_header(gguf)
                info = {k: v for k, v in header.metadata.items()
                        if isinstance(v, (int, float, str, bool))}
                info["general.parameter_count"] = header.parameter_count()
            except (GGUFHeaderError, OSError):
                info = {}
        elif path.is_dir() and (path / "config.json").is_file():
            try:
                cfg = read_config(path)
            except (OSError, ValueError):
                cfg = {}
            arch = str(cfg.get("model_type") or "")
            info = {"general.architecture": arch}
            for key, ours in (("max_position_embeddings", "context_length"),
                              ("hidden_size", "embedding_length"),
                              ("num_hidden_layers", "block_count"),
                              ("num_attention_heads", "attention.head_count"),
                              ("vocab_size", "vocab_size")):
                if isinstance(cfg.get(key), int):
                    info[f"{arch}.{ours}"] = cfg[key]
    context = _context_length(res)
    if context:
        arch = str(info.get("general.architecture") or "")
        info[f"{arch}.context_length" if arch else "context_length"] = context
    return info


def listed(ctx: ServerContext) -> list[ResidencyManager]:
    return [r for r in ctx.manager.residencies() if r.kind in OLLAMA_KINDS]


def expires_at(ctx: ServerContext, res: ResidencyManager) -> str:
    ttl = ctx.manager.idle_ttl(res)
    if ttl is None or ttl > MAX_TTL_S:  # inf, or past any date worth writing
        return NEVER
    return iso(time.time() + max(0.0, ttl - res.idle_for()))


@router.get("/api/tags", response_model=ListResponse)
async def tags(ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """The chat, vision and embedding models this server serves."""
    modified = iso(ctx.started_at)
    return {"models": [{
        "name": r.name, "model": r.name, "modified_at": modified, "size": r.memory_bytes(),
        "digest": digest(r), "details": details(r).model_dump(), "capabilities": capabilities(r),
    } for r in listed(ctx)]}


@router.get("/api/ps", response_model=ProcessResponse)
async def ps(ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """The models loaded now, and when idleness will unload each."""
    out = []
    for r in listed(ctx):
        if r.state != State.LOADED:
            continue
        size = r.memory_bytes()
        out.append({"name": r.name, "model": r.name, "size": size, "digest": digest(r),
                    "details": details(r).model_dump(), "expires_at": expires_at(ctx, r),
                    # MLX holds the weights in the device's memory (unified on Apple silicon)
                    "size_vram": size,
                    "context_length": _context_length(r)})
    return {"models": out}


def _named(req: ModelRequest) -> str:
    name = req.model or req.name
    if not name:
        raise InvalidRequest("model is required.", param="model")
    return name


def _parameters(res: ResidencyManager) -> str:
    values = res.entry.defaults.model_dump(exclude_none=True, exclude_defaults=True)
    names = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict",
             "max_context": "num_ctx"}
    return "\n".join(f"{names.get(k, k):<30} {json.dumps(v)}" for k, v in values.items()
                     if not isinstance(v, dict))


@router.post("/api/show", response_model=ShowResponse)
async def show(req: ModelRequest, ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Details, parameters, template, ``model_info`` and capabilities of one model."""
    res = ctx.manager.get(resolve_name(ctx, _named(req)))
    if res.kind not in OLLAMA_KINDS:
        raise InvalidRequest(f"Model '{res.name}' is a {res.kind} model; Ollama's API serves "
                             "text / vision / embedding models.", param="model")
    info = await asyncio.to_thread(model_info, res, ctx.config.home)
    template = ""
    async with ctx.manager.lease_if_loaded(res.name, CHAT) as lease:
        if lease is not None:
            template = str(lease.engine.tokenizer_info().get("chat_template") or "")
    parameters = _parameters(res)
    modelfile = (f"# Modelfile generated by mlxd\nFROM {res.entry.source}\n" +
                 "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()))
    return {"modelfile": modelfile, "parameters": parameters, "template": template,
            "details": details(res, info).model_dump(), "model_info": info,
            "capabilities": capabilities(res), "modified_at": iso(ctx.started_at)}


@router.get("/api/version", response_model=VersionResponse)
async def version() -> dict[str, str]:
    """The Ollama API version these routes follow (and mlxd's own)."""
    return {"version": OLLAMA_API_VERSION, "mlxd_version": __version__}


@router.delete("/api/delete")
async def delete(req: ModelRequest, ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    """Remove a model from the registry (its files stay where they are)."""
    res = ctx.manager.get(resolve_name(ctx, _named(req)))
    await ctx.manager.unregister(res.name)
    if ctx.registry is not None:
        await asyncio.to_thread(ctx.registry.remove, res.name)
    return JSONResponse({})
