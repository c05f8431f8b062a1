"""Depthwise convolutions as shifted products (engines/kernels/depthwise_conv.py) equal MLX's
``conv1d``, and the hybrid models that use them give the same logits."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engines.kernels.depthwise_conv import (
    CpuDepthwiseConv1d,
    depthwise_conv1d,
    install_cpu_depthwise_conv,
    is_depthwise,
)
from tests.helpers.tiny_hybrids import build_hybrid


@pytest.mark.parametrize(("batch", "length", "channels", "taps", "padding", "dilation", "bias"), [
    (1, 4, 2048, 4, 0, 1, False),   # a decode step of a gated delta-net (3 kept + 1 new)
    (2, 259, 96, 4, 0, 1, True),    # a prefill chunk, batched, Mamba-style bias
    (1, 1, 8, 4, 3, 1, False),      # one position, padded on both sides
    (3, 17, 5, 3, 2, 2, True),      # dilated
    (1, 7, 4, 1, 0, 1, True),       # a 1-tap kernel
])
def test_equals_mlx_conv1d(batch: int, length: int, channels: int, taps: int, padding: int,
                           dilation: int, bias: bool) -> None:
    mx.random.seed(3)
    conv = nn.Conv1d(channels, channels, taps, padding=padding, dilation=dilation,
                     groups=channels, bias=bias)
    if bias:
        conv.bias = mx.random.normal((channels,))
    x = mx.random.normal((batch, length, channels)) * 3
    want = conv(x)
    assert is_depthwise(conv)
    conv.__class__ = CpuDepthwiseConv1d
    got = conv(x)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


def test_half_precision_input_keeps_its_dtype() -> None:
    x = mx.random.normal((1, 6, 16)).astype(mx.float16)
    w = mx.random.normal((16, 4, 1))
    got = depthwise_conv1d(x, w)
    assert got.dtype == mx.float16
    want = mx.conv1d(x, w.astype(mx.float16), groups=16)
    assert mx.allclose(got, want, atol=1e-2).item()


def test_an_input_shorter_than_the_kernel_is_refused_not_read_past() -> None:
    with pytest.raises(ValueError, match="shorter than the kernel"):
        depthwise_conv1d(mx.zeros((1, 3, 8)), mx.zeros((8, 4, 1)))
    with pytest.raises(ValueError, match="shorter than the kernel"):
        depthwise_conv1d(mx.zeros((1, 2, 8)), mx.zeros((8, 2, 1)), dilation=2)


def test_only_plain_stride_1_depthwise_convolutions_are_swapped() -> None:
    class Own(nn.Conv1d):
        pass

    model = nn.Sequential(
        nn.Conv1d(8, 8, 4, groups=8),              # swapped
        nn.Conv1d(8, 8, 4, groups=1),              # dense: kept
        nn.Conv1d(8, 8, 4, groups=4),              # grouped, not depthwise: kept
        nn.Conv1d(8, 8, 4, stride=2, groups=8),    # strided: kept
        nn.Conv1d(8, 16, 4, groups=8),             # channel multiplier: kept
        Own(8, 8, 4, groups=8),                    # someone's own subclass: kept
    )
    assert install_cpu_depthwise_conv(model) == 1
    kinds = [type(m) for m in model.layers]
    assert kinds == [CpuDepthwiseConv1d, nn.Conv1d, nn.Conv1d, nn.Conv1d, nn.Conv1d, Own]


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_hybrid_models_give_the_same_logits(arch: str, tmp_path: Path, tiny_model: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    folder = build_hybrid(tmp_path / arch, arch, tiny_model)
    model, _ = load(str(folder))
    prompt = mx.array([[(i * 37) % 200 + 3 for i in range(40)]])

    def run() -> mx.array:  # a prefill, then two decode steps on the cache
        cache = make_prompt_cache(model)
        outs = [model(prompt, cache=cache)[:, -1]]
        for token in (5, 9):
            outs.append(model(mx.array([[token]]), cache=cache)[:, -1])
        return mx.concatenate(outs)

    want = run()
    assert install_cpu_depthwise_conv(model) >= 1
    got = run()
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
