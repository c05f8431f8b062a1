"""``build_app(config)``: the FastAPI application for one mlxd server.

Everything the routes need hangs off ``app.state.ctx``; tests build as many
apps as they like. The model catalog (and its errors) can be built before
the app so ``mlxd serve`` reports a bad registry before binding the port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry

from mlxd import __version__
from mlxd.config import ServerConfig
from mlxd.engines.registry import EngineRegistry
from mlxd.models.catalog import Catalog, build_catalog
from mlxd.models.manager import ModelManager
from mlxd.models.qualification import check_qualified
from mlxd.server.context import ServerContext
from mlxd.server.errors import install_error_handlers
from mlxd.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    allowed_hosts,
)
from mlxd.server.multipart import MAX_FORM_OVERHEAD_BYTES
from mlxd.server.observe import RequestMetrics, RequestObserver
from mlxd.server.openapi import install_openapi
from mlxd.server.response_store import ResponseStore
from mlxd.server.routes import (
    anthropic,
    chat,
    completions,
    embeddings,
    health,
    metrics,
    models,
    ollama,
    playground,
    rerank,
    responses,
    speech,
    tokenize,
    transcriptions,
)

log = logging.getLogger("mlxd")

ReadyHook = Callable[[ServerContext], None]


def build_app(config: ServerConfig, *, catalog: Catalog | None = None, loader: Any = None,
              on_ready: ReadyHook | None = None,
              engines: EngineRegistry | None = None) -> FastAPI:
    """Build the app; models are registered at startup and loaded on demand.

    ``engines`` says which kinds this install serves (default: probe the extras).
    """
    engine_registry = engines or EngineRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cat = catalog or build_catalog(config)
        # The same gate as `mlxd serve` (cached hashes: no second read there), for every app.
        await asyncio.to_thread(check_qualified, config, cat, cat.hasher)
        if loader is None:
            from mlxd.engines.factory import build_loader

            model_loader: Any = build_loader(config, cat.policy.budget_bytes,
                                             engines=engine_registry)
        else:
            model_loader = loader
        request_metrics = RequestMetrics(CollectorRegistry())  # this app's own registry
        manager = ModelManager(cat.policy, model_loader, servable=engine_registry.refusal,
                               observer=request_metrics)
        for reg in cat.registrations:
            manager.register(reg)
        for alias, name in cat.aliases.items():
            manager.alias(alias, name)
        ctx = ServerContext(
            config=config, manager=manager, registry=cat.registry, hasher=cat.hasher,
            response_store=ResponseStore(config.response_store_max, config.response_store_bytes),
            metrics=metrics.metrics_registry(manager, request_metrics.registry),
            request_metrics=request_metrics)
        app.state.ctx = ctx
        await manager.start()
        try:
            if cat.preload:
                await manager.preload(cat.preload)
            if on_ready is not None:
                on_ready(ctx)
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="mlxd", version=__version__, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    install_error_handlers(app)
    install_openapi(app, config)
    for module in (health, models, chat, completions, responses, anthropic, embeddings, rerank,
                   tokenize, metrics, playground, speech, ollama):
        app.include_router(module.router)
    app.include_router(transcriptions.router)
    app.add_middleware(AuthMiddleware, api_key=config.api_key, admin_key=config.admin_api_key)
    # an upload may be as large as --max-audio-upload-bytes plus its form fields
    upload = max(config.max_body_bytes, config.max_audio_upload_bytes + MAX_FORM_OVERHEAD_BYTES)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes,
                       per_path={"/v1/audio/transcriptions": upload,
                                 "/v1/audio/translations": upload})
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins,
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
    hosts = allowed_hosts(config.allowed_hosts, config.api_key, config.host)
    if hosts is not None:  # before auth and limits: a rebinding page learns nothing
        app.add_middleware(HostCheckMiddleware, allowed=hosts)
    app.add_middleware(RequestObserver)  # outermost: sees every response, refusals included
    return app
