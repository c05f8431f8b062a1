"""GappedBatchKVCache: rows of a batch drop different numbers of written positions.

Each check compares the batch against one cold single-sequence run over exactly
the tokens each row kept: the next logits, and the cache a finishing row hands
back (``extract``), after filtering rows out and extending with new ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.engines.text.gapped_cache import GappedBatchKVCache, drop_rows
from mlxd.engines.text.speculative import rewind_rows

PROMPTS = [[5, 9, 14, 3, 7, 21], [8, 2], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from mlx_lm import load

    return load(str(tiny_model))[0]


def cold(model: Any, tokens: list[int]) -> tuple[mx.array, list[Any]]:
    """The last position's logits and the cache of one sequence run alone."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    return logits[0, -1], cache


def batch_cache(model: Any, prompts: list[list[int]]) -> tuple[list[Any], mx.array]:
    """A left-padded batch prefilled with ``prompts``; its last logits per row."""
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in model.layers]
    rows = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)])
    return cache, model(rows, cache=cache)[:, -1]


def step(model: Any, cache: list[Any], columns: list[list[int]]) -> mx.array:
    """Feed each row its tokens (equal counts), return every row's last logits."""
    return model(mx.array(columns), cache=cache)[:, -1]


def close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, atol=1e-4, rtol=1e-4))


def test_rows_that_drop_different_counts_continue_as_if_never_written(model: Any) -> None:
    cache, _ = batch_cache(model, PROMPTS)
    drafts = [[40, 41, 42], [43, 44, 45], [46, 47, 48]]
    step(model, cache, drafts)
    keep = [3, 1, 0]  # row 0 keeps its whole draft, row 2 none of it
    history = [c.keys for c in cache]
    rewind_rows(cache, [3 - k for k in keep])
    assert all(isinstance(c, GappedBatchKVCache) for c in cache)
    # the rows' history stays where it is (moving it cost a second a step at 5k context)
    assert all(c.keys is k for c, k in zip(cache, history))
    kept = [p + d[:k] for p, d, k in zip(PROMPTS, drafts, keep)]
    nxt = [[50], [51], [52]]
    for _ in range(2):  # and again on top of the first gaps
        got = step(model, cache, nxt)
        kept = [k + n for k, n in zip(kept, nxt)]
        for i, tokens in enumerate(kept):
            assert close(got[i], cold(model, tokens)[0]), i
        step(model, cache, [[60, 61], [62, 63], [64, 65]])
        rewind_rows(cache, [0, 2, 1])
        kept = [kept[0] + [60, 61], kept[1], kept[2] + [64]]
    for i, tokens in enumerate(kept):  # a finishing row's cache holds only what it kept
        want = cold(model, tokens)[1]
        got_cache = [c.extract(i) for c in cache]
        assert got_cache[0].offset == len(tokens) == want[0].offset
        for g, w in zip(got_cache, want):
            assert close(g.keys, w.keys[..., :w.offset, :])


def test_gaps_follow_rows_through_filter_and_extend(model: Any) -> None:
    cache, _ = batch_cache(model, PROMPTS)
    step(model, cache, [[40, 41], [42, 43], [44, 45]])
    drop_rows(cache, [2, 0, 1])
    kept = [PROMPTS[0], PROMPTS[1] + [42, 43], PROMPTS[2] + [44]]
    for c in cache:
        c.filter([0, 2])  # row 1 (no gaps) leaves
    kept = [kept[0], kept[2]]
    newcomer = [70, 71, 72, 73, 74, 75, 76, 77, 78]  # longer than the batch's index
    joined, _ = batch_cache(model, [newcomer])
    for c, j in zip(cache, joined):
        c.extend(j)
    kept.append(newcomer)
    got = step(model, cache, [[80], [81], [82]])
    kept = [[*k, t] for k, t in zip(kept, [80, 81, 82])]
    for i, tokens in enumerate(kept):
        assert close(got[i], cold(model, tokens)[0]), i


def test_a_trim_past_a_gap_clears_it(model: Any) -> None:
    """Positions cut by a trim are written again by the next step: never left masked."""
    cache, _ = batch_cache(model, PROMPTS)
    step(model, cache, [[40, 41], [42, 43], [44, 45]])
    drop_rows(cache, [1, 0, 2])
    rewind_rows(cache, [2, 2, 2])  # every row loses the two written positions
    got = step(model, cache, [[50, 51], [52, 53], [54, 55]])
    kept = [p + t for p, t in zip(PROMPTS, [[50, 51], [52, 53], [54, 55]])]
    for i, tokens in enumerate(kept):
        assert close(got[i], cold(model, tokens)[0]), i
