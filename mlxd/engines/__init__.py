"""Engines: one module per model family. The only package that imports mlx_* libraries.

Import engine modules lazily (``mlxd.engines.factory.create_engine``) so that
the HTTP layer never pulls MLX in at import time.
"""
