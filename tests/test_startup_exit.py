"""A server that cannot start says why and exits non-zero, in every mode (issue 31 items
8 and 11): a model path that does not exist is named as such, and a sharded group
whose ranks cannot load the model makes the launcher (``mlxd serve --hosts``) exit
non-zero although ``mlx.launch`` itself exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.group import START_TIMEOUT_S, free_port_run
from tests.helpers.server import free_port

ROOT = Path(__file__).resolve().parent.parent


def serve(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MLXD_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mlxd", "serve", *args, "--no-starter",
                           "--blas", "off", "--port", str(free_port())], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("path", ["/abs/path/that/does/not/exist", "~/no/such/model",
                                  "./no/such/model"])
def test_a_missing_model_path_is_named_as_missing(path: str, test_home: Path) -> None:
    run = serve(path, home=test_home)
    assert run.returncode == 2, run.stdout + run.stderr
    err = " ".join(run.stderr.split())  # rich wraps long lines
    assert f"source '{path}' does not exist" in err, err
    assert "must not start with" not in err


@pytest.mark.slow
def test_a_group_whose_ranks_cannot_load_the_model_exits_non_zero(
        session_dir: Path, test_home: Path) -> None:
    from tests.helpers.tiny_models import build_llama

    model = session_dir / "tiny-llama-3-heads"
    if not model.exists():  # 3 heads do not split over 2 ranks
        build_llama(model, hidden=48, layers=1, heads=3, seed=3)
    run = serve(str(model), "--served-model-name", "tiny", "--hosts", "127.0.0.1,127.0.0.1",
                "--group-port", str(free_port_run(3)), "--group-timeout", "3",
                home=test_home, timeout=START_TIMEOUT_S)
    out = run.stdout + run.stderr
    assert "cannot be split over 2 ranks" in out, out[-3000:]
    assert run.returncode != 0, out[-3000:]
    assert "the group failed: rank" in out, out[-3000:]
