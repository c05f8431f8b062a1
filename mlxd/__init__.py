"""mlxd: one inference server for every MLX model family."""

__version__ = "0.1.0"
