"""The side-by-side benchmark behind ``make bench``: mlxd vs mlx_lm.server vs vllm-mlx vs raw
mlx-lm on the same SmolLM2-135M float32 folder. Not part of the ``mlxd`` package."""
