"""The pieces under the embedding and rerank engines: TokenBatcher packing and the CPU GELU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from mlxd.engines.encoders.token_batcher import (
    CPU_PADDING,
    GPU_PADDING,
    Encoded,
    TokenBatcher,
    worth_padding,
)


class Recorder:
    """A forward pass that returns each row's length and remembers each batch's lengths."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, batch: Sequence[Encoded]) -> np.ndarray:
        self.batches.append([len(x) for x in batch])
        return np.array([[float(len(x))] for x in batch], dtype=np.float32)


def _inputs(*lengths: int) -> list[Encoded]:
    return [Encoded(list(range(n))) for n in lengths]


def _drain(batcher: TokenBatcher) -> None:
    while batcher.has_work():
        batcher.step()


def test_concurrent_requests_share_one_batch() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=1024)
    jobs = [batcher.submit(_inputs(10, 12)), batcher.submit(_inputs(11)),
            batcher.submit(_inputs(9, 10, 12))]
    _drain(batcher)
    assert len(forward.batches) == 1 and sorted(forward.batches[0]) == [9, 10, 10, 11, 12, 12]
    assert [j.reply.result()[:, 0].tolist() for j in jobs] == [[10, 12], [11], [9, 10, 12]]


def test_padded_size_stays_within_the_token_budget() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=100)
    job = batcher.submit(_inputs(*[30] * 7))
    _drain(batcher)
    assert all(len(b) * max(b) <= 100 for b in forward.batches)
    assert sum(len(b) for b in forward.batches) == 7
    assert job.reply.result().shape == (7, 1)


def test_short_rows_are_not_padded_to_long_ones() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=10_000)
    batcher.submit(_inputs(256, 250, 20, 18, 240))
    _drain(batcher)
    assert forward.batches == [[256, 250, 240], [20, 18]]
    assert worth_padding(130, 256, GPU_PADDING) and not worth_padding(100, 256, GPU_PADDING)
    assert worth_padding(1, 30, GPU_PADDING)


def test_cpu_batches_pad_less_than_gpu_batches() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=10_000, padding=CPU_PADDING)
    batcher.submit(_inputs(40, 36, 30, 25, 12, 10))
    _drain(batcher)
    assert forward.batches == [[40, 36], [30, 25], [12, 10]]


def test_a_sequence_longer_than_the_budget_runs_alone() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=50)
    job = batcher.submit(_inputs(80, 5))
    _drain(batcher)
    assert forward.batches == [[80], [5]]
    assert job.reply.result()[:, 0].tolist() == [80, 5]


def test_cancelled_requests_are_skipped() -> None:
    forward = Recorder()
    batcher = TokenBatcher(forward, token_budget=1000)
    gone = batcher.submit(_inputs(7, 7))
    kept = batcher.submit(_inputs(8))
    assert gone.reply.cancel()
    _drain(batcher)
    assert forward.batches == [[8]]
    assert kept.reply.result()[:, 0].tolist() == [8]


def test_a_failing_batch_fails_its_requests_and_the_queue_goes_on() -> None:
    calls = {"n": 0}

    def forward(batch: Sequence[Encoded]) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return np.ones((len(batch), 1), dtype=np.float32)

    batcher = TokenBatcher(forward, token_budget=300)
    first = batcher.submit(_inputs(200))
    second = batcher.submit(_inputs(10))
    _drain(batcher)
    with pytest.raises(RuntimeError, match="boom"):
        first.reply.result()
    assert second.reply.result().shape == (1, 1)


def test_closing_fails_waiting_work_and_refuses_new() -> None:
    from mlxd.errors import Overloaded

    batcher = TokenBatcher(Recorder(), token_budget=100)
    waiting = batcher.submit(_inputs(5))
    batcher.close()
    with pytest.raises(Overloaded):
        waiting.reply.result()
    with pytest.raises(Overloaded):
        batcher.submit(_inputs(5))


def test_rational_gelu_matches_the_exact_gelu() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd.engines.kernels.activations import RationalGELU, gelu_rational

    x = mx.linspace(-20.0, 20.0, 100_001)
    assert float(mx.abs(gelu_rational(x) - nn.gelu(x)).max().item()) < 2e-6  # type: ignore[arg-type]
    assert float(mx.abs(RationalGELU()(x) - nn.gelu(x)).max().item()) < 2e-6  # type: ignore[arg-type]


def test_fast_gelu_replaces_only_exact_gelu_modules() -> None:
    import mlx.nn as nn

    from mlxd.engines.kernels.activations import RationalGELU, use_fast_gelu

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.exact = nn.GELU()
            self.tanh = nn.GELU(approx="precise")
            self.inner = [nn.Sequential(nn.Linear(2, 2), nn.GELU())]

    block = Block()
    assert use_fast_gelu(block) == 2
    assert isinstance(block.exact, RationalGELU)
    assert type(block.tanh) is nn.GELU
    assert isinstance(block.inner[0].layers[1], RationalGELU)
