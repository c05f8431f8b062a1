"""Depthwise 1-D convolutions on CPU as shifted multiply-adds.

Hybrid models run a short causal depthwise convolution (``nn.Conv1d`` with
``groups == channels``, kernel 4) in front of every recurrent layer: Qwen3-Next
and Qwen3.5 gated delta-nets, Mamba-2, Nemotron-H. MLX's CPU ``conv1d`` takes
a general grouped path for it, far slower than the K multiply-adds it is: one
[1, 259, 2048] call (a 256-token prefill chunk of the benchmark hybrid) takes
10.8 ms against 1.6 ms as four shifted products, a decode step's [1, 4, 2048]
0.21 ms against 0.02 (one core, float32, MLX 0.32). On the 131M qwen3_next that was about 1 s of a 3,900-token
prefill's and 1.6 ms of each decode step's time.

``install_cpu_depthwise_conv`` swaps the class of a loaded model's depthwise
``nn.Conv1d`` instances for ``CpuDepthwiseConv1d`` (same parameters, same
function up to float rounding): the change lives on that model's own modules
and ends with it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def depthwise_conv1d(x: mx.array, weight: mx.array, padding: int = 0,
                     dilation: int = 1) -> mx.array:
    """``mx.conv1d(x, weight, 1, padding, dilation, groups=C)`` for ``x`` [B, L, C] and
    ``weight`` [C, K, 1], as K shifted element-wise products."""
    if padding:
        x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    taps = weight.shape[1]
    length = x.shape[1] - dilation * (taps - 1)
    if length <= 0:
        raise ValueError(f"conv1d input of {x.shape[1]} positions is shorter than the "
                         f"kernel's span of {dilation * (taps - 1) + 1}")
    w = weight[:, :, 0].astype(x.dtype)
    out = x[:, :length] * w[:, 0]
    for k in range(1, taps):
        start = k * dilation
        out = out + x[:, start:start + length] * w[:, k]
    return out


class CpuDepthwiseConv1d(nn.Conv1d):
    """An ``nn.Conv1d`` with ``groups == in == out channels`` and stride 1, computed by
    ``depthwise_conv1d``."""

    def __call__(self, x: mx.array) -> mx.array:
        y = depthwise_conv1d(x, self.weight, self.padding, self.dilation)
        if "bias" in self:
            y = y + self.bias
        return y


def is_depthwise(module: Any) -> bool:
    """Whether ``module`` is a plain ``nn.Conv1d`` that ``CpuDepthwiseConv1d`` computes."""
    if type(module) is not nn.Conv1d:
        return False
    out_channels, _, per_group = module.weight.shape
    return (per_group == 1 and module.groups == out_channels
            and module.stride == 1)


def install_cpu_depthwise_conv(model: Any) -> int:
    """Compute ``model``'s depthwise convolutions as shifted products; how many."""
    found = [m for m in model.modules() if is_depthwise(m)]
    for module in found:
        module.__class__ = CpuDepthwiseConv1d
    return len(found)
