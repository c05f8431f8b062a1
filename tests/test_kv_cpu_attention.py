"""Attention over quantized KV on CPU (``engines/kernels/quantized_attention.py``).

On CPU a loaded model attends over its quantized cache by dequantizing it a part at a
time and running the float attention: the same function as mlx-lm's two
``quantized_matmul`` calls up to float rounding, for prefill chunks and decode steps,
causal, boolean and additive masks and grouped-query heads, whether the cache is taken
whole or in parts; a tiny model's greedy tokens on 8-bit KV are the same with the path
on and off; the path lives and goes with the CPU path's reference count; the transient
it holds is in the engine's reserve.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engines.kernels import prefill, quantized_attention
from mlxd.engines.kernels.quantized_attention import (
    DEQUANTIZE_PART_BYTES,
    dequantize,
    dequantized_attention_bytes,
)
from mlxd.engines.text.engine import MLXLanguageModel, TextEngineOptions
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.runtime.worker import ModelWorker
from tests.helpers.decoding import run_jobs

pytestmark = pytest.mark.skipif(not prefill.on_cpu(), reason="the CPU path")


def quantized(x: mx.array, bits: int, group_size: int, extra: int = 0) -> tuple[Any, ...]:
    """``x`` quantized inside a longer buffer, then cut to its length (as a cache's
    ``keys_and_values`` returns it: a strided view)."""
    pad = mx.zeros((*x.shape[:2], extra, x.shape[3]), dtype=x.dtype)
    whole = mx.quantize(mx.concatenate([x, pad], axis=2), group_size=group_size, bits=bits)
    return tuple(t[..., :x.shape[2], :] for t in whole)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_fused_dequantize_equals_mlxs(bits: int, group_size: int) -> None:
    x = mx.random.normal((2, 3, 77, 128), key=mx.random.key(bits + group_size))
    triple = quantized(x, bits, group_size, extra=51)
    want = mx.dequantize(*triple, group_size=group_size, bits=bits)
    got = dequantize(triple, group_size, bits)
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()


# (rows, query heads, KV heads, queries, keys, head dim, group size)
SHAPES = {"prefill-gqa": (1, 9, 3, 256, 700, 64, 64),
          "prefill-rows": (2, 4, 4, 40, 300, 128, 128),
          "decode-gqa": (3, 4, 2, 1, 300, 64, 32),
          "decode-long": (4, 6, 2, 1, 5000, 64, 64),
          "verify": (2, 8, 2, 5, 90, 64, 64)}


def masks(rows: int, queries: int, keys: int) -> dict[str, Any]:
    """What mlx-lm passes: none, "causal", a batch's boolean mask with left padding (rows
    that start later), the same as an additive mask, and a (queries x keys) one."""
    padded = base.create_causal_mask(queries, keys - queries,
                                     left_padding=mx.array([7 * r for r in range(rows)]))
    return {"none": None, "causal": "causal", "bool": padded,
            "additive": mx.where(padded, 0.0, -1e9), "2d": padded[0, 0]}


@pytest.mark.parametrize("whole", [True, False], ids=["default-parts", "small-parts"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "2d"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_attention_over_quantized_kv_equals_mlx_lms(
        bits: int, shape: str, mask_kind: str, whole: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rows, heads, kv_heads, n_q, n_k, dim, group = SHAPES[shape]
    if not whole:  # parts of one head (rows and heads split) or of a few rows
        monkeypatch.setattr(quantized_attention, "DEQUANTIZE_PART_BYTES",
                            dim * n_k * 4 * (1 if shape != "prefill-rows" else 4))
    k1, k2, k3 = mx.random.split(mx.random.key(n_q * 7 + n_k), 3)
    q = mx.random.normal((rows, heads, n_q, dim), key=k1)
    qk = quantized(mx.random.normal((rows, kv_heads, n_k, dim), key=k2), bits, group, 33)
    qv = quantized(mx.random.normal((rows, kv_heads, n_k, dim), key=k3), bits, group, 33)
    mask = masks(rows, n_q, n_k)[mask_kind]
    cache = QuantizedKVCache(group_size=group, bits=bits)
    scale = dim ** -0.5
    got = prefill._cpu_sdpa(q, qk, qv, cache, scale, mask)
    # mlx-lm scales its queries in place: give it its own copy
    want = base.quantized_scaled_dot_product_attention(q * 1, qk, qv, scale=scale, mask=mask,
                                                       group_size=group, bits=bits)
    assert got.shape == want.shape == (rows, heads, n_q, dim)
    assert mx.abs(got - want).max().item() < 1e-4


def test_float_kv_keeps_its_path() -> None:
    """A float cache is attended over as before the change (NumPy for big calls, mlx-lm's
    own for small ones): the quantized branch only sees caches with ``bits``."""
    q = mx.random.normal((1, 4, 1, 16))
    k, v = mx.random.normal((1, 2, 40, 16)), mx.random.normal((1, 2, 40, 16))
    got = prefill._cpu_sdpa(q, k, v, KVCache(), 0.25, None)
    want = base.scaled_dot_product_attention(q, k, v, cache=KVCache(), scale=0.25, mask=None)
    assert mx.array_equal(got, want).item()


def test_attention_sinks_over_quantized_kv_stay_refused_as_upstream() -> None:
    q, kv = mx.zeros((1, 2, 1, 64)), mx.quantize(mx.zeros((1, 2, 8, 64)), bits=8)
    with pytest.raises(ValueError, match="sinks"):
        prefill._cpu_sdpa(q, kv, kv, QuantizedKVCache(), 1.0, None, sinks=mx.zeros((2,)))


def test_the_self_check_covers_the_quantized_path() -> None:
    assert prefill._quantized_ok(mx.random.key(1))
    assert prefill._self_check()


def test_one_part_holds_at_most_the_budget_or_one_head() -> None:
    # SmolLM2: 3 KV heads of 64 float32 values, 8,192 tokens: 2 MiB a head, 6 MiB a row
    head = 64 * 4
    assert dequantized_attention_bytes(1, 3, head, 8192) == 2 * 6 * (1 << 20)
    assert dequantized_attention_bytes(16, 3, head, 8192) == 2 * DEQUANTIZE_PART_BYTES
    # one head over a long context is more than a part: it is what one part holds
    assert dequantized_attention_bytes(16, 8, 128 * 2, 131072) == 2 * 128 * 2 * 131072


# -- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_engine(tiny_model_hd64: Path) -> Any:
    engine = MLXLanguageModel("q8", tiny_model_hd64, ModelWorker("q8"),
                              TextEngineOptions(kv_bits=8, prefill_step_size=64))
    engine.load()
    yield engine
    engine.close()


def test_the_path_goes_with_the_last_model_that_holds_it(tiny_model_hd64: Path) -> None:
    """Installed with the CPU path at load, reference counted, undone at the last close:
    mlx-lm's attention (and its quantized path) is back."""
    engines = [MLXLanguageModel(n, tiny_model_hd64, ModelWorker(n), TextEngineOptions(kv_bits=8))
               for n in ("a", "b")]
    module_name = None
    for engine in engines:
        engine.load()
        module_name = type(engine.model).__module__
    module = sys.modules[str(module_name)]
    held_before = prefill._Installs.counts.get(str(module_name), 0) - 2
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa
    engines[0].close()
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa
    engines[1].close()
    if held_before == 0:  # no other model of this process (a fixture's) holds it
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


# long enough that prefill chunks (64 queries) take NumPy's attention, decode steps MLX's
PROMPTS = [[(i * 37) % 1900 + 5 for i in range(n)] for n in (300, 170, 12)]


def test_greedy_tokens_on_8_bit_kv_are_the_same_with_the_path_on_and_off(
        q8_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = q8_engine.model
    module = sys.modules[type(model).__module__]
    assert module.scaled_dot_product_attention is prefill._cpu_sdpa  # installed at load

    def tokens() -> list[list[int]]:
        dec = LMBatchDecoder(model, eos_ids=[], max_num_seqs=4, prefill_step_size=64,
                             kv_quantization=q8_engine.kv_quantization)
        return run_jobs(dec, [{"tokens": p, "max": 12, "join": j}
                              for p, j in zip(PROMPTS, (0, 2, 3))], [])

    on = tokens()
    monkeypatch.setattr(module, "scaled_dot_product_attention",
                        base.scaled_dot_product_attention)  # mlx-lm's quantized_matmul
    off = tokens()
    assert on == off and all(len(t) == 12 for t in on)


def test_the_engine_reserves_one_dequantized_part(q8_engine: Any, tiny_model_hd64: Path) -> None:
    plain = MLXLanguageModel("f", tiny_model_hd64, ModelWorker("f"),
                             TextEngineOptions(prefill_step_size=64))
    plain.load()
    try:
        rows = max(q8_engine.scheduler.decoder.prefill_rows, q8_engine.scheduler.max_num_seqs)
        extra = dequantized_attention_bytes(rows, 2, 64 * 4, q8_engine.context_length)
        assert extra > 0
        assert q8_engine._transient_bytes == plain._transient_bytes + extra
    finally:
        plain.close()
