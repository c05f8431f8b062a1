"""Few-row float32 matmuls through BLAS's sgemv on CPU (mlxd/engines/kernels/cpu_gemv.py).

The path exists where MLX's matmuls run on a BLAS whose symbols the process can see: the
OpenBLAS ``mlxd serve`` preloads. A test process has MLX's own (hidden) reference BLAS, so
``test_under_openblas`` runs this file again in a child with OpenBLAS preloaded, where the
other tests run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.blas import find_openblas, preload_env
from mlxd.engines.kernels import cpu_gemv
from mlxd.engines.kernels.cpu_gemv import (
    MAX_ROWS,
    CpuGemvEmbedding,
    CpuGemvLinear,
    blas_sgemv,
    gemv_rows,
    install_cpu_gemv,
)

REPO = Path(__file__).resolve().parent.parent
INNER = "MLXD_TEST_CPU_GEMV_CHILD"
inner = pytest.mark.skipif(os.environ.get(INNER) != "1",
                           reason="runs in test_under_openblas's child process")


@pytest.mark.skipif(os.environ.get(INNER) == "1" or not sys.platform.startswith("linux")
                    or find_openblas(os.environ) is None,
                    reason="needs Linux and an installed OpenBLAS (libopenblas0-pthread)")
def test_under_openblas(tiny_model: Path) -> None:
    library = find_openblas(os.environ)
    assert library is not None
    env = {**preload_env(dict(os.environ), library), INNER: "1",
           "MLXD_TEST_TINY_MODEL": str(tiny_model)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rs", "-k", "not under_openblas", __file__], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " skipped" not in run.stdout.splitlines()[-1]  # every inner test ran


@pytest.fixture
def child_model() -> Path:
    return Path(os.environ["MLXD_TEST_TINY_MODEL"])


@pytest.fixture
def sgemv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls into the real ``cblas_sgemv`` (a spy: each call still runs it)."""
    real = blas_sgemv()
    calls: list[int] = []

    def spy(*args: Any) -> None:
        calls.append(args[2])  # the row count of the weight
        real(*args)

    monkeypatch.setattr(cpu_gemv, "blas_sgemv", lambda: spy)
    return calls


@inner
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 1, 64), (1, 3, 64), (4, 64)])
def test_equals_mlx_matmul_up_to_rounding(shape: tuple[int, ...],
                                          sgemv_calls: list[int]) -> None:
    mx.random.seed(1)
    x, w = mx.random.normal(shape), mx.random.normal((300, 64))
    got = gemv_rows(x, w)
    assert got is not None and got.shape == (*shape[:-1], 300) and got.dtype == mx.float32
    assert mx.allclose(got, x @ w.T, atol=1e-4, rtol=1e-5).item()
    rows = x.size // 64
    assert sgemv_calls == [300] * rows  # one sgemv per row, nothing else


@inner
def test_each_row_is_computed_alone() -> None:
    """Up to MAX_ROWS rows, a row's output is bit-identical to that row sent alone, so a
    decode step's logits do not depend on which sequences share it."""
    mx.random.seed(2)
    x, w = mx.random.normal((MAX_ROWS, 96)), mx.random.normal((500, 96))
    together = gemv_rows(x, w)
    assert together is not None
    for i in range(MAX_ROWS):
        alone = gemv_rows(x[i:i + 1], w)
        assert alone is not None and mx.array_equal(alone[0], together[i]).item()


@inner
@pytest.mark.parametrize("case", ["too many rows", "float16 input", "float16 weight",
                                  "wrong width", "empty", "transposed weight"])
def test_calls_it_does_not_cover_are_left_to_mlx(case: str, sgemv_calls: list[int]) -> None:
    x, w = mx.ones((MAX_ROWS + 1, 32)), mx.ones((16, 32))
    if case == "float16 input":
        x = mx.ones((1, 32), dtype=mx.float16)
    elif case == "float16 weight":
        x, w = mx.ones((1, 32)), w.astype(mx.float16)
    elif case == "wrong width":
        x = mx.ones((1, 31))
    elif case == "empty":
        x = mx.ones((0, 32))
    elif case == "transposed weight":  # a view, not row-major memory
        x, w = mx.ones((1, 32)), mx.ones((32, 16)).T
    assert gemv_rows(x, w) is None
    assert sgemv_calls == []


@inner
def test_only_plain_float32_linears_and_embeddings_are_swapped() -> None:
    class Own(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(32, 64),                                   # swapped
        nn.Linear(32, 64, bias=False),                       # swapped
        nn.Embedding(100, 32),                               # swapped (a tied head)
        Own(32, 64),                                         # someone's own subclass: kept
        nn.QuantizedLinear(64, 64, bias=False),              # quantized: kept
        nn.Linear(32, 64),                                   # float16 below: kept
    )
    model.layers[5].set_dtype(mx.float16)
    assert install_cpu_gemv(model) == 3
    kinds = [type(m) for m in model.layers]
    assert kinds == [CpuGemvLinear, CpuGemvLinear, CpuGemvEmbedding, Own,
                     nn.QuantizedLinear, nn.Linear]


@inner
def test_swapped_modules_compute_the_same(sgemv_calls: list[int]) -> None:
    mx.random.seed(3)
    linear, head = nn.Linear(48, 80), nn.Embedding(120, 48)
    x_one, x_many = mx.random.normal((1, 1, 48)), mx.random.normal((2, 5, 48))
    want = [linear(x_one), linear(x_many), head.as_linear(x_one), head.as_linear(x_many)]
    install_cpu_gemv(nn.Sequential(linear, head))
    got = [linear(x_one), linear(x_many), head.as_linear(x_one), head.as_linear(x_many)]
    assert sgemv_calls == [80, 120]  # one row each; the 10-row calls stay with MLX
    for g, w in zip(got, want):
        assert mx.allclose(g, w, atol=1e-4, rtol=1e-5).item()  # bias included
    assert mx.array_equal(got[1], want[1]).item() and mx.array_equal(got[3], want[3]).item()
    assert mx.array_equal(head(mx.array([3, 7])), head.weight[mx.array([3, 7])]).item()


@inner
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_models_decode_the_same(arch: str, tmp_path: Path, child_model: Path,
                                sgemv_calls: list[int]) -> None:
    """A tied-head llama and a hybrid: a prefill, then decode steps of one and of
    two sequences, with and without the swap."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from tests.helpers.tiny_hybrids import build_hybrid

    folder = (child_model if arch == "llama"
              else build_hybrid(tmp_path / arch, arch, child_model))
    model, _ = load(str(folder))
    prompt = mx.array([[(i * 37) % 200 + 3 for i in range(24)]] * 2)

    def run(batch: int) -> mx.array:
        cache = make_prompt_cache(model)
        outs = [model(prompt[:batch], cache=cache)[:, -1]]
        for token in (5, 9, 11):
            outs.append(model(mx.array([[token]] * batch), cache=cache)[:, -1])
        return mx.concatenate(outs)

    want = [run(1), run(2)]
    assert not sgemv_calls
    assert install_cpu_gemv(model) >= 3
    got = [run(1), run(2)]
    assert sgemv_calls  # the decode steps went through sgemv
    for g, w in zip(got, want):
        assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item()
