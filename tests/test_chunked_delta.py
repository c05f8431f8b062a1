"""The chunked gated delta rule (engines/kernels/chunked_delta.py) equals mlx-lm's per-token
loop, and hybrid models use it for prefill on CPU."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from mlxd.engines.kernels.chunked_delta import CHUNK, MIN_TOKENS, cpu_gated_delta_update
from mlxd.engines.kernels.prefill import on_cpu

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the chunked path is for CPU")


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, b: int = 2,
            seed: int = 0, gate_scale: float = 2.0) -> dict:
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((b, t, hk, dk), key=keys[0])
    k = mx.random.normal((b, t, hk, dk), key=keys[1])
    q, k = gated_delta.normalize_qk(q, k, inv_scale=dk ** -0.5, eps=1e-6)
    return {"q": q, "k": k, "v": mx.random.normal((b, t, hv, dv), key=keys[2]),
            "a": mx.random.normal((b, t, hv), key=keys[3]) * gate_scale,
            "b": mx.random.normal((b, t, hv), key=keys[4]),
            "A_log": mx.random.uniform(-1, 2, (hv,), key=keys[5]),
            "dt_bias": mx.random.normal((hv,), key=keys[6]),
            "state": mx.random.normal((b, hv, dv, dk), key=keys[7]) * 0.3}


def _both(inputs: dict, mask: mx.array | None = None, **kw: object
          ) -> tuple[tuple[mx.array, mx.array], tuple[mx.array, mx.array]]:
    args = [inputs[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state")]
    theirs = gated_delta.gated_delta_update(*args, mask, **kw)  # type: ignore[arg-type]
    ours = cpu_gated_delta_update(*args, mask, **kw)  # type: ignore[arg-type]
    return ours, theirs


def _close(ours: tuple[mx.array, mx.array], theirs: tuple[mx.array, mx.array],
           real: mx.array | None = None, tol: float = 2e-5) -> None:
    (y, s), (y_ref, s_ref) = ours, theirs
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and s.shape == s_ref.shape
    if real is not None:  # a padding step's output is never read
        y, y_ref = mx.where(real[..., None, None], y, 0), mx.where(real[..., None, None], y_ref, 0)
    assert mx.isfinite(y).all().item() and mx.isfinite(s).all().item()
    scale = max(1.0, mx.abs(s_ref).max().item())
    assert mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item() < tol * scale
    assert mx.abs(s - s_ref).max().item() < tol * scale


@pytest.mark.parametrize("t", [MIN_TOKENS, CHUNK * 3, CHUNK * 3 + 17, 300])
def test_equals_mlx_lms_loop_over_chunk_boundaries(t: int) -> None:
    inputs = _inputs(t)
    _close(*_both(inputs))


def test_equals_with_padding_masks_and_without_a_state() -> None:
    """A left-padded batch (mlx-lm's padded prefill): padding leaves the state as it was;
    no initial state means zeros."""
    inputs = _inputs(200, b=3)
    real = mx.arange(200)[None] >= mx.array([[0], [45], [199]])
    _close(*_both(inputs, real), real=real)
    _close(*_both({**inputs, "state": None}, real), real=real)


@pytest.mark.parametrize("kw", [{"lower_bound": -5.0}, {"allow_neg_eigval": True}])
def test_equals_for_the_other_gate_forms(kw: dict) -> None:
    _close(*_both(_inputs(150), **kw))


def test_grouped_heads_and_half_precision_inputs() -> None:
    inputs = _inputs(130, hk=1, hv=4, dk=32, dv=16)
    half = {n: (x.astype(mx.bfloat16) if n in ("q", "k", "v") else x)
            for n, x in inputs.items()}
    ours, theirs = _both(half)
    assert ours[0].dtype == mx.bfloat16 and ours[1].dtype == mx.float32
    _close(ours, theirs, tol=2e-2)


def test_the_worst_decays_stay_finite() -> None:
    """Decays that forget everything at once (g = 0: a huge rate, a huge gate input,
    even an infinite one) and decays that forget nothing (g = 1)."""
    inputs = _inputs(140, gate_scale=1.0)
    forget = {**inputs, "A_log": mx.array([30.0, 80.0, 0.0, -80.0])}
    _close(*_both(forget))
    spikes = inputs["a"].at[:, ::7].add(mx.array(3e38))  # softplus(3e38 + x): inf
    spikes = spikes.at[:, 5::11].add(mx.array(-3e38))   # and -inf: g = 1
    _close(*_both({**inputs, "a": spikes}))


def test_short_calls_and_per_channel_decays_keep_mlx_lms_loop_bit_for_bit() -> None:
    """Decode and speculative verify steps (fewer than MIN_TOKENS tokens) and Kimi
    Linear's per-channel decays are mlx-lm's own computation."""
    for inputs in (_inputs(9), _inputs(MIN_TOKENS - 1)):
        (y, s), (y_ref, s_ref) = _both(inputs)
        assert mx.array_equal(y, y_ref).item() and mx.array_equal(s, s_ref).item()
    inputs = _inputs(100)
    per_channel = {**inputs, "A_log": inputs["A_log"].reshape(4, 1),
                   "dt_bias": mx.zeros((4, 16))}
    per_channel["a"] = mx.repeat(inputs["a"][..., None], 16, -1)
    (y, s), (y_ref, s_ref) = _both(per_channel)
    assert mx.array_equal(y, y_ref).item() and mx.array_equal(s, s_ref).item()


@pytest.fixture(scope="module")
def tiny_qwen3_next(session_dir: Path, tiny_model: Path) -> Path:
    from tests.helpers.tiny_hybrids import build_hybrid

    out = session_dir / "tiny-qwen3_next"
    if not (out / "config.json").exists():
        build_hybrid(out, "qwen3_next", tiny_model)
    return out


def test_a_hybrid_model_prefills_through_the_chunked_rule(
        tiny_qwen3_next: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed with the CPU prefill path: the model's module calls it, and a
    300-token prefill gives mlx-lm's logits and recurrent states."""
    import sys

    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engines.kernels import chunked_delta, prefill

    model = load(str(tiny_qwen3_next))[0]
    module = sys.modules[type(model).__module__]
    handle = prefill.install_cpu_prefill_attention(model)
    assert handle is not None
    try:
        assert module.gated_delta_update is chunked_delta.cpu_gated_delta_update
        calls: list[int] = []
        monkeypatch.setattr(chunked_delta, "chunked_gated_delta",
                            _counting(chunked_delta.chunked_gated_delta, calls))
        tokens = mx.random.randint(0, 2000, (1, 300), key=mx.random.key(4))
        cache = make_prompt_cache(model)
        ours = model(tokens, cache=cache)
        assert calls  # the recurrent layers went through the chunked rule
        monkeypatch.setattr(chunked_delta, "MIN_TOKENS", 1 << 30)  # mlx-lm's loop
        ref_cache = make_prompt_cache(model)
        expected = model(tokens, cache=ref_cache)
        assert mx.abs(ours - expected).max().item() < 1e-3
        assert (mx.argmax(ours, -1) == mx.argmax(expected, -1)).mean().item() > 0.99
        states = tree_flatten([c.state for c in cache])
        ref_states = tree_flatten([c.state for c in ref_cache])
        assert len(states) == len(ref_states) > 0
        for (_, x), (_, x_ref) in zip(states, ref_states):
            assert (x is None) == (x_ref is None)
            if x is not None:
                assert mx.abs(x - x_ref).max().item() < 1e-3
    finally:
        handle.undo()
    if module.gated_delta_update is not chunked_delta.cpu_gated_delta_update:
        assert module.gated_delta_update is gated_delta.gated_delta_update


def _counting(fn: object, calls: list[int]) -> object:
    def wrapped(*args: object, **kw: object) -> object:
        calls.append(1)
        return fn(*args, **kw)  # type: ignore[operator]
    return wrapped
