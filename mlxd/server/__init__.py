"""HTTP layer: FastAPI app factory, one router per API family. Never imports MLX."""

from mlxd.server.app import build_app

__all__ = ["build_app"]
