"""Per-app state handed to every route (no module-level globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from prometheus_client import CollectorRegistry

from mlxd.config import ServerConfig
from mlxd.models.manager import ModelManager
from mlxd.models.qualification import FileHasher
from mlxd.models.registry import RegistryFile
from mlxd.server.drain import Drain
from mlxd.server.observe import RequestMetrics
from mlxd.server.response_store import ResponseStore


@dataclass
class ServerContext:
    """Everything a route may use, built once per app by ``build_app``'s startup."""

    config: ServerConfig
    manager: ModelManager
    response_store: ResponseStore  # previous_response_id / GET /v1/responses/{id}
    metrics: CollectorRegistry  # what GET /metrics exports
    registry: RegistryFile | None = None
    started_at: float = field(default_factory=time.time)
    hasher: FileHasher = field(default_factory=FileHasher)  # --require-qualified re-hashing
    request_metrics: RequestMetrics | None = None  # per-request instruments (in ``metrics``)
    drain: Drain = field(default_factory=Drain)  # graceful shutdown (server/drain.py)


def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx
