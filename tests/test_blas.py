"""``mlxd serve --blas``: when OpenBLAS is preloaded, and that the re-exec really does it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxd.blas import (
    ENV_ACTIVE,
    ENV_LIBRARY,
    find_openblas,
    launched_as_serve,
    plan_blas,
    preload_env,
)
from tests.helpers.server import free_port

REPO = Path(__file__).resolve().parent.parent
MISSING = [Path("/nonexistent/libopenblas.so.0")]


def test_off_never_preloads() -> None:
    assert plan_blas("off", {}, "linux").action == "none"


def test_other_platforms_are_left_alone() -> None:
    assert plan_blas("openblas", {}, "darwin").action == "none"


def test_unknown_mode_is_an_error() -> None:
    assert plan_blas("mkl", {}, "linux").action == "error"


def test_missing_library_is_a_hint_in_auto_and_an_error_when_asked_for() -> None:
    auto = plan_blas("auto", {}, "linux", paths=MISSING)
    assert auto.action == "none" and "libopenblas0-pthread" in auto.reason
    assert plan_blas("openblas", {}, "linux", paths=MISSING).action == "error"


def test_env_selects_the_mode_when_no_flag() -> None:
    assert plan_blas(None, {"MLXD_BLAS": "off"}, "linux").action == "none"
    assert plan_blas(None, {"MLXD_BLAS": "openblas"}, "linux", paths=MISSING).action == "error"


def test_already_preloaded_or_active_is_not_preloaded_again() -> None:
    env = {"LD_PRELOAD": "/opt/x/libopenblas.so.0"}
    assert plan_blas("openblas", env, "linux", paths=MISSING).action == "none"
    assert plan_blas("openblas", {ENV_ACTIVE: "/x/libopenblas.so.0"}, "linux").action == "none"


def test_explicit_library_that_is_not_blas_is_not_used(tmp_path: Path) -> None:
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"not a library")
    assert find_openblas({ENV_LIBRARY: str(fake)}) is None


def test_preload_env_puts_the_library_first_and_marks_the_process() -> None:
    env = preload_env({"LD_PRELOAD": "/a.so", "X": "1"}, Path("/b/libopenblas.so.0"))
    assert env["LD_PRELOAD"] == "/b/libopenblas.so.0 /a.so"
    assert env[ENV_ACTIVE] == "/b/libopenblas.so.0" and env["X"] == "1"


def test_only_the_serve_command_itself_is_re_executed() -> None:
    assert launched_as_serve(["/venv/bin/mlxd", "serve", "m"])
    assert launched_as_serve(["/repo/mlxd/__main__.py", "serve"])
    assert launched_as_serve(["/repo/mlxd/cli/serve.py", "m"])
    assert not launched_as_serve(["/venv/bin/pytest", "serve"])
    assert not launched_as_serve(["/venv/bin/mlxd", "bench"])


PROBE = ("import mlx.core as mx, numpy; from mlxd.blas import sgemm_provider, fast_sgemm; "
         "from mlxd.engines.text.speculative import SpeculativeOptions as S; "
         "print(sgemm_provider(), fast_sgemm(), S().enabled, S(mode='off').enabled, "
         "S(mode='prompt-lookup').enabled)")


@pytest.mark.skipif(not sys.platform.startswith("linux") or find_openblas(os.environ) is None,
                    reason="needs Linux and an installed OpenBLAS (libopenblas0-pthread)")
def test_the_blas_serving_mlx_matmuls_decides_whether_auto_speculates() -> None:
    """``sgemm_provider`` names the library whose ``cblas_sgemm`` MLX's matmuls reach; only
    a preloaded OpenBLAS counts (numpy's own OpenBLAS is loaded in both runs and never
    serves MLX), and ``--speculative auto`` follows it on a CPU."""
    library = find_openblas(os.environ)
    assert library is not None
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV_ACTIVE)}
    plain = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    assert plain == ["None", "False", "False", "False", "True"]
    fast = subprocess.run([sys.executable, "-c", PROBE], env=preload_env(env, library),
                          cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    assert Path(fast[0]).resolve() == library.resolve()
    assert fast[1:] == ["True", "True", "False", "True"]


def _mapped_openblas(pid: int) -> bool:
    return "libopenblas" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or find_openblas(os.environ) is None,
                    reason="needs Linux and an installed OpenBLAS (libopenblas0-pthread)")
def test_serve_re_executes_itself_with_openblas_in_the_same_pid(tiny_model: Path,
                                                                test_home: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV_ACTIVE)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", str(tiny_model), "--port", str(port),
         "--no-starter", "--home", str(test_home), "--blas", "openblas", "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("mlxd serve did not become ready")
        assert _mapped_openblas(proc.pid)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(ENV_ACTIVE.encode() + b"=") for e in environ)
        # with matmuls on OpenBLAS, --speculative auto turns prompt lookup on
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                   json={"model": name, "prompt": "a b a b", "max_tokens": 2}).raise_for_status()
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models/{name}", timeout=10).json()
        assert card["speculative"] == "prompt-lookup", card
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
