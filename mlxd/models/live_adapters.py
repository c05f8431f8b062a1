"""LoRA adapters added to and removed from a registered base model while it serves.

An adapter lives in its base model's entry (``adapters``: name -> folder) and is a
model name of its own (an alias of the base). Adding one checks it against the
base's files, counts its bytes in the base's estimate and the budget, attaches it
to the loaded engine between two scheduler steps (running requests keep their
rows), and only then makes its name reachable: nothing is half-added. Removing
one makes its name unreachable at once (new requests get 404), waits for the
requests that hold it to finish, then detaches it. Changes are serialized.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mlxd.config import ServerConfig
from mlxd.errors import Conflict, InvalidRequest, ModelNotFound, Overloaded
from mlxd.models.catalog import CatalogError, adapter_bytes, local_path_of
from mlxd.models.manager import ModelManager
from mlxd.models.residency import ResidencyManager, State
from mlxd.models.spec import ModelEntry, ModelKind

_POLL_S = 0.05


def adapter_base(manager: ModelManager, name: str) -> ResidencyManager | None:
    """The base model serving LoRA adapter ``name``, or None when it names no adapter."""
    try:
        res = manager.get(name)
    except ModelNotFound:
        return None
    return res if name in res.entry.adapters else None


def _bytes_of(entry: ModelEntry, config: ServerConfig) -> int:
    """What ``entry``'s adapters add to its estimate (checked against the base's files
    when they are here); blocking: run in a thread."""
    try:
        return adapter_bytes(entry, ModelKind.TEXT, local_path_of(entry, config.home))
    except CatalogError as e:
        raise InvalidRequest(str(e), param="adapter_path") from None


async def _engine_call(res: ResidencyManager, method: str, *args: object) -> None:
    """Run ``engine.method(*args)`` on the model's thread if the base is (being) loaded;
    a base loaded later reads its adapters from the entry."""
    if res.state == State.LOADING:
        try:
            await res.wait_loaded()
        except Exception:
            return  # the load failed: the next one reads the entry
    loaded = res.loaded
    if res.state == State.LOADED and loaded is not None:
        await loaded.worker.run(getattr(loaded.engine, method), *args)


async def add_adapter(manager: ModelManager, config: ServerConfig, base: str, name: str,
                      folder: str) -> ResidencyManager:
    """Serve the adapter in ``folder`` as model ``name`` over registered model ``base``."""
    async with manager.adapter_changes:
        res = manager.get(base)  # 404 for an unknown base
        if base in res.entry.adapters:
            raise InvalidRequest(f"'{base}' is a LoRA adapter of model '{res.name}', not a base "
                                 "model.", param="base")
        if res.kind != ModelKind.TEXT:
            raise InvalidRequest(f"Model '{res.name}' is a {res.kind} model; LoRA adapters "
                                 "are served over text models.", param="base")
        try:
            owner = manager.resolve_name(name)
        except ModelNotFound:
            owner = None
        if owner is None and any(name in r.entry.adapters for r in manager.residencies()):
            raise Conflict(f"Adapter '{name}' is being removed; retry when it is gone.",
                           code="model_in_use")
        if owner is not None:
            what = "a LoRA adapter" if name in manager.get(name).entry.adapters else \
                "a model" if name == owner else f"an alias of model '{owner}'"
            raise Conflict(f"'{name}' is already the name of {what}: remove it first or "
                           "choose another name.", code="model_exists")
        path = str(Path(folder).expanduser().absolute())
        old = res.entry
        new = old.model_copy(update={"adapters": {**old.adapters, name: path}})
        before, after = await asyncio.gather(asyncio.to_thread(_bytes_of, old, config),
                                             asyncio.to_thread(_bytes_of, new, config))
        growth = max(0, after - before)
        if res.state in (State.LOADED, State.LOADING):
            used, budget = manager.used_bytes(), manager.policy.budget_bytes
            if used + growth > budget:
                raise Overloaded(f"Adding adapter '{name}' ({growth} bytes) to loaded model "
                                 f"'{res.name}' would exceed the memory budget ({used} of "
                                 f"{budget} bytes in use); unload a model first.",
                                 retry_after=5, code="insufficient_memory")
        await _engine_call(res, "add_adapter", name, Path(path))
        res.entry = new
        res.estimate += after - before
        manager.alias(name, res.name)
        return res


async def remove_adapter(manager: ModelManager, name: str, wait: bool = True,
                         timeout: float = 300.0) -> ResidencyManager:
    """Stop serving adapter ``name``: new requests for it get 404 at once; with ``wait``
    the requests that hold it finish first (without: 409 while any runs)."""
    res = adapter_base(manager, name)
    if res is None:
        raise InvalidRequest(f"'{name}' is not a LoRA adapter.", param="model")
    if name in res.removing_adapters:
        raise Conflict(f"Adapter '{name}' is already being removed.", code="model_in_use")
    if res.adapter_users[name] and not wait:
        raise Conflict(f"Adapter '{name}' is in use by {res.adapter_users[name]} request(s); "
                       "retry later or unload with wait=true.", code="model_in_use")
    res.removing_adapters.add(name)
    manager.unalias(name)  # from here on a request for it is a 404
    try:
        deadline = time.monotonic() + timeout
        while res.adapter_users[name]:
            if time.monotonic() > deadline:
                raise Conflict(f"Adapter '{name}' stayed in use for {timeout:.0f}s.",
                               code="model_in_use")
            await asyncio.sleep(_POLL_S)
        async with manager.adapter_changes:
            await _engine_call(res, "remove_adapter", name)
            old = res.entry
            new = old.model_copy(update={"adapters": {
                n: f for n, f in old.adapters.items() if n != name}})
            saved = await asyncio.to_thread(_saved_bytes, old, new)
            res.entry = new
            res.estimate = max(0, res.estimate - saved)
            del res.adapter_users[name]
    except BaseException:
        if name in res.entry.adapters:  # still attached: still served
            manager.alias(name, res.name)
        raise
    finally:
        res.removing_adapters.discard(name)
    return res


def _saved_bytes(old: ModelEntry, new: ModelEntry) -> int:
    """What removing adapters takes off the estimate (files gone: what was counted stays)."""
    try:
        return adapter_bytes(old, ModelKind.TEXT, None) - adapter_bytes(new, ModelKind.TEXT, None)
    except CatalogError:
        return 0
