"""CPU prefill path (engines/prefill.py): the base-2 attention and SwiGLU equal
mlx-lm's, the served model uses them and prefills in short chunks, with unchanged
greedy tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engines.prefill import CPU_PREFILL_CHUNK, base2_attention, base2_swiglu, on_cpu

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the CPU prefill path only runs on CPU")


def _reference(q: mx.array, k: mx.array, v: mx.array, mask: object) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["causal", "bool", "additive", "none"])
def test_base2_attention_equals_mlx(kind: str) -> None:
    mx.random.seed(3)
    q = mx.random.normal((2, 8, 40, 16))
    k, v = mx.random.normal((2, 2, 60, 16)), mx.random.normal((2, 2, 60, 16))
    allowed = mx.random.uniform(shape=(2, 1, 40, 60)) > 0.3
    mask = {"causal": "causal", "bool": allowed, "additive": mx.where(allowed, 0.0, -1e9),
            "none": None}[kind]
    diff = mx.abs(base2_attention(q, k, v, 0.25, mask) - _reference(q, k, v, mask)).max()  # type: ignore[arg-type]
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


def test_a_row_with_every_key_masked_stays_finite() -> None:
    q, k, v = mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8))
    mask = mx.zeros((1, 1, 4, 4), dtype=mx.bool_)
    assert mx.isfinite(base2_attention(q, k, v, 1.0, mask)).all().item()


def test_served_model_prefills_in_short_chunks_with_the_same_tokens(
        tiny_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engines import prefill

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
    monkeypatch.setattr(prefill, "MIN_QUERY_TOKENS", 1 << 30)  # every call: MLX's kernel
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

    from mlxd.engines import prefill

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


def test_an_unchecked_mlx_lm_whose_attention_differs_keeps_its_own(
        tiny_model: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.utils import load

    from mlxd.engines import prefill

    model, _ = load(str(tiny_model))[:2]
    monkeypatch.setattr(prefill, "CHECKED_MLX_LM", ())
    monkeypatch.setattr(prefill, "base2_attention",
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
