"""Per-app state handed to every route (no module-level globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mlxd.config import ServerConfig
from mlxd.models.manager import ModelManager
from mlxd.models.qualification import FileHasher
from mlxd.models.registry import RegistryFile


@dataclass
class ServerContext:
    config: ServerConfig
    manager: ModelManager
    registry: RegistryFile | None = None
    started_at: float = field(default_factory=time.time)
    extras: dict[str, Any] = field(default_factory=dict)
    hasher: FileHasher = field(default_factory=FileHasher)  # --require-qualified re-hashing


def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx
