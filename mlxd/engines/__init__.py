"""Engines: one module per model family. The only package that imports mlx_* libraries.

Engine modules are imported lazily, when a model of their kind is built
(``mlxd.engines.factory``), so the HTTP layer never pulls MLX in at import time.
"""
