"""CPU prefill path (engines/kernels/prefill.py): the NumPy attention and base-2 SwiGLU equal
mlx-lm's, the served model uses them and prefills in short chunks, with unchanged
greedy tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engines.kernels.prefill import CPU_PREFILL_CHUNK, base2_swiglu, host_attention, on_cpu

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the CPU prefill path only runs on CPU")


def _reference(q: mx.array, k: mx.array, v: mx.array, mask: object) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["causal", "bool", "additive", "none"])
def test_host_attention_equals_mlx(kind: str) -> None:
    mx.random.seed(3)
    q = mx.random.normal((2, 8, 40, 16))
    k, v = mx.random.normal((2, 2, 60, 16)), mx.random.normal((2, 2, 60, 16))
    allowed = mx.random.uniform(shape=(2, 1, 40, 60)) > 0.3
    mask = {"causal": "causal", "bool": allowed, "additive": mx.where(allowed, 0.0, -1e9),
            "none": None}[kind]
    diff = mx.abs(host_attention(q, k, v, 0.25, mask) - _reference(q, k, v, mask)).max()  # type: ignore[arg-type]
    assert diff.item() < 1e-5


def test_base2_swiglu_equals_mlx_lms_even_at_the_extremes() -> None:
    from mlx_lm.models.activations import swiglu

    mx.random.seed(5)
    gate = mx.random.normal((2, 70, 96)) * 12
    up = mx.random.normal((2, 70, 96))
    assert mx.allclose(base2_swiglu(gate, up), swiglu(gate, up), rtol=1e-5, atol=1e-6).item()
    big = mx.array([-1e30, -200.0, -88.0, -1e-30, 0.0, 1e-30, 88.0, 200.0, 3e38])
    ones = mx.ones_like(big)
    ours, theirs = base2_swiglu(big, ones), swiglu(big, ones)
    assert mx.isfinite(ours).all().item()  # no NaN where the sigmoid saturates
    assert mx.allclose(ours, theirs, rtol=1e-6, atol=1e-30).item()


def test_base2_silu_and_precise_swiglu_equal_mlx_over_prefill_chunks_only() -> None:
    """Prefill-sized calls take base 2 (same values up to rounding, same dtype, no NaN at
    the extremes); decode-sized ones are mlx's own, bit for bit."""
    import mlx.nn as nn
    from mlx_lm.models.activations import precise_swiglu

    from mlxd.engines.kernels.prefill import (
        MIN_QUERY_TOKENS,
        _cpu_precise_swiglu,
        _cpu_silu,
        base2_silu,
        base2_swiglu,
    )

    mx.random.seed(6)
    x = mx.random.normal((1, MIN_QUERY_TOKENS + 3, 40)) * 12
    x = mx.concatenate([x, mx.array([[[-1e30, -200.0, -88.0, 0.0, 88.0, 3e38] * 5 + [0.0] * 10]
                                     * (MIN_QUERY_TOKENS + 3)])], axis=-1)
    ours = _cpu_silu(x)
    assert mx.array_equal(ours, base2_silu(x)).item()  # the base-2 path was taken
    assert mx.isfinite(ours).all().item()
    assert mx.allclose(ours, nn.silu(x), rtol=1e-5, atol=1e-30).item()
    step = x[:, :1]
    assert mx.array_equal(_cpu_silu(step), nn.silu(step)).item()

    h = mx.zeros((1, MIN_QUERY_TOKENS, 4, 16), dtype=mx.bfloat16)
    gate = mx.random.normal(h.shape) * 8
    up = mx.random.normal(h.shape)
    got, want = _cpu_precise_swiglu(h, gate, up), precise_swiglu(h, gate, up)
    assert mx.array_equal(got, base2_swiglu(gate, up).astype(mx.bfloat16)).item()
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=1e-2).item()
    one = (h[:, :1], gate[:, :1], up[:, :1])
    assert mx.array_equal(_cpu_precise_swiglu(*one), precise_swiglu(*one)).item()


def test_a_hybrid_models_nn_is_mlx_nn_with_silu_changed_and_restored(
        tmp_path: object, tiny_model: object) -> None:
    """The module-level ``nn`` of a hybrid's module is rebound while it is loaded: every
    other name is mlx.nn's, the logits are the same, and mlx.nn comes back on unload."""
    import sys
    from pathlib import Path

    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engines.kernels import prefill
    from tests.helpers.tiny_hybrids import build_hybrid

    folder = build_hybrid(Path(str(tmp_path)) / "h", "qwen3_next", tiny_model)  # type: ignore[arg-type]
    model, _ = load(str(folder))[:2]
    module = sys.modules[type(model).__module__]
    prompt = mx.array([[(i * 31) % 200 + 3 for i in range(prefill.MIN_QUERY_TOKENS + 20)]])

    def logits() -> mx.array:
        return model(prompt, cache=make_prompt_cache(model))

    was = module.nn
    want = logits() if was is nn else None
    handle = prefill.install_cpu_prefill_attention(model)
    assert handle is not None
    assert module.nn is prefill.NN_WITH_CPU_SILU
    assert module.nn.Linear is nn.Linear and module.nn.silu is not nn.silu
    got = logits()
    handle.undo()
    if want is not None:  # no other loaded model in this process holds the path
        assert module.nn is nn
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_a_row_with_every_key_masked_stays_finite() -> None:
    q, k, v = mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8))
    mask = mx.zeros((1, 1, 4, 4), dtype=mx.bool_)
    assert mx.isfinite(host_attention(q, k, v, 1.0, mask)).all().item()


def test_served_model_prefills_in_short_chunks_with_the_same_tokens(
        tiny_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engines.kernels import prefill

    with tiny_server.client() as http:  # type: ignore[attr-defined]
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
    engine = tiny_server.ctx.manager.get("tiny").engine  # type: ignore[attr-defined]
    assert engine.scheduler.prefill_step_size == CPU_PREFILL_CHUNK
    module = sys.modules[type(engine.model).__module__]
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa
    assert module.swiglu is prefill._cpu_swiglu
    mx.random.seed(4)
    tokens = mx.random.randint(0, 2000, (1, 300))
    ours = engine.model(tokens, cache=make_prompt_cache(engine.model))
    monkeypatch.setattr(prefill, "MIN_QUERY_TOKENS", 1 << 30)  # every call: MLX's kernels
    monkeypatch.setattr(prefill, "HOST_ATTENTION_MIN_SCORES", 1 << 60)
    expected = engine.model(tokens, cache=make_prompt_cache(engine.model))
    assert mx.abs(ours - expected).max().item() < 1e-4
    assert (mx.argmax(ours, -1) == mx.argmax(expected, -1)).all().item()


def test_the_cpu_path_is_reference_counted_and_undone_on_the_last_unload(
        tiny_model: object) -> None:
    """Like every upstream patch: active only while a model uses it, the very upstream
    function restored after the last unload."""
    import sys

    from mlx_lm.models import activations, base
    from mlx_lm.utils import load

    from mlxd.engines.kernels import prefill

    model, _ = load(str(tiny_model))[:2]
    module = sys.modules[type(model).__module__]
    was_installed = module.scaled_dot_product_attention is prefill._cpu_sdpa
    first = prefill.install_cpu_prefill_attention(model)
    second = prefill.install_cpu_prefill_attention(model)
    assert first is not None and second is not None
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa
    assert module.swiglu is prefill._cpu_swiglu
    first.undo()
    first.undo()  # idempotent: one model's share is released once
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa
    assert module.swiglu is prefill._cpu_swiglu
    second.undo()
    if not was_installed:  # no other loaded model in this process holds it
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
        assert module.swiglu is activations.swiglu


def test_numpys_own_blas_runs_on_one_thread_while_the_path_is_installed(
        tiny_model: object) -> None:
    """NumPy's wheel bundles its own OpenBLAS: while a model uses the CPU path its pool is
    limited to one thread (it would spin against MLX's), and restored after the last
    unload. In a fresh process, so no other loaded model holds the path."""
    import json
    import subprocess
    import sys

    script = """
import json, sys
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
from mlx_lm.utils import load
from mlxd.engines.kernels import prefill

def threads():
    return [i["num_threads"] for i in threadpool_info() if "scipy_openblas" in i["prefix"]]

threadpool_limits(limits={"libscipy_openblas": 2})
before = threads()
model = load(sys.argv[1])[0]
first = prefill.install_cpu_prefill_attention(model)
second = prefill.install_cpu_prefill_attention(model)
installed = threads()
first.undo()
one_left = threads()
second.undo()
print(json.dumps([before, installed, one_left, threads()]))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tiny_model)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    before, installed, one_left, after = json.loads(out.strip().splitlines()[-1])
    if not before:
        pytest.skip("this NumPy does not bundle its own OpenBLAS")
    assert (before, installed, one_left, after) == ([2], [1], [1], [2])


def test_an_unchecked_mlx_lm_whose_attention_differs_keeps_its_own(
        tiny_model: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.utils import load

    from mlxd.engines.kernels import prefill

    model, _ = load(str(tiny_model))[:2]
    monkeypatch.setattr(prefill, "CHECKED_MLX_LM", ())
    monkeypatch.setattr(prefill, "host_attention",
                        lambda q, k, v, scale, mask: prefill.mx.zeros_like(q))
    assert prefill.install_cpu_prefill_attention(model) is None
    monkeypatch.undo()
    monkeypatch.setattr(prefill, "CHECKED_MLX_LM", ())
    monkeypatch.setattr(prefill, "base2_swiglu", lambda gate, x: gate * x)
    assert prefill.install_cpu_prefill_attention(model) is None
    monkeypatch.undo()
    monkeypatch.setattr(prefill, "CHECKED_MLX_LM", ())
    handle = prefill.install_cpu_prefill_attention(model)  # unchecked, self-check passes
    assert handle is not None
    handle.undo()


def test_host_attention_reads_strided_half_precision_caches() -> None:
    """A KV cache is a slice of a larger buffer (strided) and may be bfloat16, which NumPy
    cannot read: the result equals MLX's attention on the same inputs, in their dtype."""
    mx.random.seed(6)
    q = mx.random.normal((1, 4, 70, 16)).astype(mx.bfloat16)
    buffer = mx.random.normal((1, 2, 256, 16)).astype(mx.bfloat16)
    k, v = buffer[:, :, :90], buffer[:, :, 100:190]
    ours = host_attention(q, k, v, 0.25, "causal")
    assert ours.dtype == mx.bfloat16
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k.astype(mx.float32),
                                               v.astype(mx.float32), scale=0.25, mask="causal")
    assert mx.abs(ours.astype(mx.float32) - ref).max().item() < 2e-2
