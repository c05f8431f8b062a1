"""kokoro (CPU): transposed and dilated 1-D convolutions computed as matmuls.

MLX's CPU backend runs ``conv_transpose1d`` and dilated ``conv1d`` through a
direct loop, not through BLAS: Kokoro's iSTFTNet generator upsamples with
transposed convolutions and its residual blocks use dilations 3 and 5, so a
short sentence took minutes. Measured with OpenBLAS on a loaded 2-core box: a
512->256 channel, kernel 20, stride 10 transposed convolution over 600 frames
18.3 s upstream vs 1.0 s as a matmul plus overlap-add; a dilation-3 kernel-3
conv over 3000x256 4.7 s vs 0.3 s (the undilated conv upstream already uses
BLAS); a whole sentence of the test-size Kokoro 31 s vs 7 s.

Only ``ConvWeighted.__call__`` (the weight-normalised convolution of
mlx-audio's Kokoro) is replaced: it is handed ``mx.conv1d`` or
``mx.conv_transpose1d`` by its callers, and the replacement swaps in the
matmul forms for groups=1 (dilated conv1d; transposed conv1d), leaving every
other case to MLX. Applied on the CPU only, while a Kokoro model is loaded.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxd.engines.upstream.patching import Patch


def conv1d_dilated(x: mx.array, weight: mx.array, stride: int = 1, padding: int = 0,
                   dilation: int = 1, groups: int = 1) -> mx.array:
    """``mx.conv1d`` (channels last; weight (out, k, in)) as one im2col matmul."""
    if groups != 1 or dilation == 1:  # upstream is fast (or the case is not ours)
        return mx.conv1d(x, weight, stride=stride, padding=padding, dilation=dilation,
                         groups=groups)
    out_ch, k, in_ch = weight.shape
    xp = mx.pad(x, [(0, 0), (padding, padding), (0, 0)]) if padding else x
    length = (xp.shape[1] - dilation * (k - 1) - 1) // stride + 1
    taps = [xp[:, j * dilation: j * dilation + (length - 1) * stride + 1: stride, :]
            for j in range(k)]
    cols = mx.concatenate(taps, axis=-1)  # (B, length, k * in)
    return cols @ weight.reshape(out_ch, k * in_ch).T


def conv_transpose1d_mm(x: mx.array, weight: mx.array, stride: int = 1, padding: int = 0,
                        dilation: int = 1, groups: int = 1,
                        output_padding: int = 0) -> mx.array:
    """``mx.conv_transpose1d`` as a matmul (every input frame times every tap) plus an
    overlap-add of the taps, ``stride`` frames apart."""
    if groups != 1 or dilation != 1:
        return mx.conv_transpose1d(x, weight, stride=stride, padding=padding,
                                   dilation=dilation, groups=groups,
                                   output_padding=output_padding)
    out_ch, k, in_ch = weight.shape
    batch, frames, _ = x.shape
    blocks = -(-k // stride)
    w = weight.transpose(2, 1, 0)  # (in, k, out)
    if blocks * stride != k:
        w = mx.pad(w, [(0, 0), (0, blocks * stride - k), (0, 0)])
    z = (x @ w.reshape(in_ch, blocks * stride * out_ch)).reshape(
        batch, frames, blocks, stride * out_ch)
    total = (frames + blocks - 1) * stride
    y = mx.zeros((batch, total, out_ch), dtype=z.dtype)
    for j in range(blocks):  # block j of the taps lands j * stride frames later
        part = z[:, :, j, :].reshape(batch, frames * stride, out_ch)
        y = y + mx.pad(part, [(0, 0), (j * stride, (blocks - 1 - j) * stride), (0, 0)])
    full = (frames - 1) * stride + k
    return y[:, padding: full - padding + output_padding, :]


def _fast(conv: Any) -> Any:
    if conv is mx.conv_transpose1d:
        return conv_transpose1d_mm
    if conv is mx.conv1d:
        return conv1d_dilated
    return conv


def _conv_weighted() -> Any:
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    return ConvWeighted


def targets(model: Any = None, processor: Any = None) -> list[tuple[Any, str, Any]]:
    cls = _conv_weighted()
    upstream = cls.__call__

    def call(self: Any, x: mx.array, conv: Any) -> mx.array:
        return upstream(self, x, _fast(conv))

    call.__doc__ = "ConvWeighted.__call__ with transposed and dilated convs as matmuls."
    return [(cls, "__call__", call)]


def self_check(model: Any = None, processor: Any = None) -> bool:
    """The matmul forms equal MLX's own convolutions on small random cases."""
    key = mx.random.key(0)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    x = mx.random.normal((2, 9, 5), key=k1)
    ok = True
    for k, s, p in ((7, 3, 2), (4, 2, 1), (20, 10, 5), (3, 1, 1)):
        w = mx.random.normal((6, k, 5), key=k2)
        want = mx.conv_transpose1d(x, w, stride=s, padding=p)
        got = conv_transpose1d_mm(x, w, stride=s, padding=p)
        ok = ok and want.shape == got.shape and bool(mx.allclose(want, got, atol=1e-4))
    xd = mx.random.normal((2, 30, 5), key=k3)
    for k, d, p, s in ((3, 3, 3, 1), (5, 2, 4, 1), (3, 5, 0, 2)):
        w = mx.random.normal((6, k, 5), key=k4)
        want = mx.conv1d(xd, w, stride=s, padding=p, dilation=d)
        got = conv1d_dilated(xd, w, stride=s, padding=p, dilation=d)
        ok = ok and want.shape == got.shape and bool(mx.allclose(want, got, atol=1e-4))
    return ok


PATCH = Patch(
    name="kokoro-cpu-conv-matmul", families=frozenset({"kokoro"}),
    checked={"mlx": ("0.32.4",), "mlx-audio": ("0.6.2",)}, targets=targets,
    self_check=self_check,
    why="MLX's CPU transposed and dilated 1-D convolutions are direct loops, 20-70x slower "
        "than the same work as a matmul")
