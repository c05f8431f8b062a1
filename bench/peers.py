"""Install the peer servers that do not live in mlxd's venv (vllm-mlx) into their own venv.

vllm-mlx 0.6.0 pins ``mlx-lm<0.32`` (mlxd uses 0.32), so it gets ``bench/.venv-vllm-mlx``.
Its wheel requires torchvision, which drags in torch: we install the local CPU build
``torch==2.13.0`` first and constrain it so pip can never pull another, then remove
torchvision again because vllm-mlx fails to start with it installed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_MLX = "vllm-mlx==0.6.0"
TORCH = "torch==2.13.0"
HERE = Path(__file__).resolve().parent
VLLM_MLX_VENV = HERE / ".venv-vllm-mlx"
INSTALL_TIMEOUT_S = 1800


def _pip(venv: Path, *args: str, constraints: Path) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q",
           *args]
    if args[0] == "install":
        cmd += ["-c", str(constraints)]
    subprocess.run(cmd, check=True, timeout=INSTALL_TIMEOUT_S)


def ensure_vllm_mlx(venv: Path = VLLM_MLX_VENV,
                    say: Callable[[str], None] = print) -> Path:
    """The ``vllm-mlx`` executable, installing it into ``venv`` the first time."""
    exe = venv / "bin" / "vllm-mlx"
    marker = venv / f".installed-{VLLM_MLX}"
    if exe.exists() and marker.exists():
        return exe
    say(f"installing {VLLM_MLX} into {venv} (first run only; a few minutes)")
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    _pip(venv, "install", "--upgrade", "pip", constraints=constraints)
    _pip(venv, "install", TORCH, constraints=constraints)
    _pip(venv, "install", VLLM_MLX, "mlx[cpu]", TORCH, constraints=constraints)
    _pip(venv, "uninstall", "-y", "torchvision", constraints=constraints)
    if not exe.exists():
        raise RuntimeError(f"{VLLM_MLX} installed but {exe} is missing")
    marker.write_text("ok\n")
    return exe


if __name__ == "__main__":
    print(ensure_vllm_mlx())
