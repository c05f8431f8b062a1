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
