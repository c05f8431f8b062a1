"""mlx-lm's and mlx-vlm's converters, for ``mlxd model convert`` (the only MLX imports it needs).

Both converters print progress to stdout; it is swallowed so ``--json`` output stays one
document. ``trust_remote_code`` is passed explicitly (mlx-vlm defaults it to True).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any


def run_converter(converter: str, src: Path, dest: Path, *, dtype: str,
                  q_bits: int | None = None, q_group_size: int | None = None,
                  q_mode: str | None = None, trust_remote_code: bool = False) -> None:
    """Convert ``src`` into ``dest`` (which must not exist) with ``mlx-lm`` or ``mlx-vlm``.

    ``q_mode`` set means quantise (``q_bits`` / ``q_group_size`` default per mode).
    """
    kwargs: dict[str, Any] = dict(dtype=dtype, quantize=q_mode is not None,
                                  trust_remote_code=trust_remote_code)
    if q_mode is not None:
        kwargs.update(q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode)
    with contextlib.redirect_stdout(io.StringIO()):
        if converter == "mlx-vlm":
            from mlx_vlm import convert as vlm_convert

            from mlxd.engines.vision.convert import legacy_names

            if q_mode is not None:
                kwargs.update(q_bits=q_bits or 4, q_group_size=q_group_size or 64)
            # newer transformers names, which mlx-vlm refuses, renamed in a scratch copy
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".renamed-") as tmp:
                vlm_convert(str(legacy_names(src, Path(tmp))), mlx_path=str(dest), **kwargs)
        elif converter == "mlx-lm":
            from mlx_lm import convert as lm_convert

            lm_convert(str(src), mlx_path=str(dest), **kwargs)
        else:
            raise ValueError(f"unknown MLX converter {converter!r} (mlx-lm or mlx-vlm)")


def fuse_adapter(base: Path, adapter: Path, dest: Path, *, dtype: str | None = None) -> int:
    """Write ``base`` with the mlx-lm adapter in ``adapter`` (LoRA or DoRA) fused into its
    weights to ``dest`` (which must not exist), the way ``mlx_lm.fuse`` does: load with
    the adapter, replace each adapted layer by its ``fuse()``, save with config and
    tokenizer. Returns the number of fused layers."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load, save

    model, tokenizer, config = load(str(base), adapter_path=str(adapter),  # type: ignore[misc]
                                    return_config=True)
    fused = [(name, module.fuse()) for name, module in model.named_modules()
             if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        config["torch_dtype"] = dtype
    with contextlib.redirect_stdout(io.StringIO()):
        save(dest, str(base), model, tokenizer, config, donate_model=False)
    return len(fused)
