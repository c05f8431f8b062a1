"""What admission by live KV counts beyond the tokens, and the copies a step no longer
makes (docs/memory.md, "The transient reserve"): a batch holds every row padded to the
longest, so grants are counted that way; a row joining the running batch does not leave a
second copy of it; the prefix cache makes room before it copies a state, and never copies
one larger than its cap. MLX's own byte counts (active and peak memory), a real model."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxd.engines.text.kv_admission import HeldBeside, KVLedger, batch_footprint
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.prefix_cache import PrefixCache
from mlxd.engines.text.sampling import greedy
from tests.helpers.tiny_models import build_llama

LAYERS = 8


def ledger(allowance_tokens: int) -> KVLedger:
    """A ledger of one byte per token whose allowance is ``allowance_tokens``."""
    return KVLedger(1, lambda: (allowance_tokens, 0), lambda: HeldBeside(0, 0, 0))


def test_grants_are_counted_padded_to_the_longest_row() -> None:
    kv = ledger(1000)
    assert kv.admit("long", 400) and kv.admit("short", 300)
    assert kv.granted_bytes() == 2 * 400  # the short row is padded to the long one
    # 400 + 300 + 100 = 800 tokens would fit, but the batch would hold 3 x 400
    assert not kv.admit("third", 100)
    assert batch_footprint([400, 300, 100]) == 1200 > 1000
    kv.release("long")
    assert kv.admit("third", 100) and kv.granted_bytes() == 2 * 300


def test_growth_preempts_when_the_padded_batch_outgrows_the_allowance() -> None:
    kv = ledger(1000)
    assert kv.admit("old", 300) and kv.admit("new", 300)
    # the old row passes its grant and asks for 256 more: 2 x 557 > 1000 (the tokens,
    # 857, would fit), so the newest is preempted
    preempted, ended = kv.grow([("old", 1.0, 301, 2000, True), ("new", 2.0, 200, 2000, True)])
    assert preempted == ["new"] and not ended
    assert kv.granted_bytes() == 557


def test_a_row_that_cannot_be_preempted_grows_to_an_equal_share() -> None:
    kv = ledger(1000)
    assert kv.admit("a", 400) and kv.admit("b", 300)
    # neither can be preempted (a grammar): the row passing its grant gets what keeps
    # 2 rows x its grant within the allowance, not the 700 tokens the others leave
    preempted, ended = kv.grow([("a", 1.0, 401, 2000, False), ("b", 2.0, 200, 2000, False)])
    assert not preempted and not ended
    assert kv.granted_bytes() == 2 * 500


@pytest.fixture(scope="module")
def deep_model(session_dir: Path, tiny_model: Path) -> Any:
    """The tiny Llama with more layers, so one layer's share of a copy is small."""
    from mlx_lm import load

    folder = session_dir / "tiny-llama-deep"
    if not (folder / "config.json").exists():
        build_llama(folder, hidden=64, layers=LAYERS, heads=4, seed=3, tokenizer_from=tiny_model)
    return load(str(folder))[0]


def _prompt(n: int, seed: int) -> SimpleNamespace:
    return SimpleNamespace(tokens=[(seed * 31 + k * 7) % 500 + 3 for k in range(n)])


@pytest.fixture
def quiet() -> Iterator[None]:
    gc.collect()
    mx.clear_cache()
    yield


def test_a_row_joining_the_running_batch_leaves_no_second_copy_of_it(
        deep_model: Any, quiet: None) -> None:
    """A prompt that ends its prefill joins the running batch: mlx-lm concatenates every
    layer's cache with it, lazily, and the scheduler then copies the new row's state into
    the prefix cache, which evaluates the concatenation. Done a layer at a time, memory
    peaks at most a few layers' share of the batch above what stays, not at a second copy
    of the whole batch (all layers' new buffers built while the old ones are held)."""
    dec = LMBatchDecoder(deep_model, eos_ids=[], max_num_seqs=4, prefill_step_size=256)
    for seed, n in ((1, 600), (2, 650)):
        dec.insert(_prompt(n, seed), 0, None, greedy, [], set(), 50)
    while not dec.next()[1]:  # until both decode
        pass
    late = dec.insert(_prompt(900, 3), 0, None, greedy, [], set(), 50)
    for _ in range(20):
        gc.collect()
        mx.reset_peak_memory()
        prompts, _ = dec.next()
        if any(p.end_of_prompt for p in prompts):
            break
    else:
        pytest.fail("the late prompt never joined")
    cache, tokens = dec.extract_cache([late])[late]  # as the scheduler stores it
    PrefixCache(max_bytes=1 << 30).insert(list(tokens), cache)
    transient = mx.get_peak_memory() - mx.get_active_memory()
    batch = dec.cache_nbytes()
    assert transient < batch * 3 // LAYERS, (transient, batch)
    dec.close()


def test_a_join_and_the_step_after_it_build_no_copy_of_the_batch(deep_model: Any, quiet: None) -> None:
    """Without a prefix cache to store the new row, the running batch's concatenation is
    evaluated as rows join (``settle_joins``), a layer at a time, each layer of the
    moving row let go of once concatenated: neither the join step nor the next decode
    step holds a second copy of the batch or of the moving row."""
    dec = LMBatchDecoder(deep_model, eos_ids=[], max_num_seqs=4, prefill_step_size=256)
    for seed, n in ((1, 600), (2, 650)):
        dec.insert(_prompt(n, seed), 0, None, greedy, [], set(), 50)
    while not dec.next()[1]:
        pass
    dec.insert(_prompt(900, 3), 0, None, greedy, [], set(), 50)
    joined = False
    while not joined:
        gc.collect()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        joined = any(p.end_of_prompt for p in dec.next()[0])
    # the join step itself: a few layers' share, not the moving row's KV once more
    transient = mx.get_peak_memory() - max(before, mx.get_active_memory())
    assert transient < dec.cache_nbytes() * 3 // LAYERS, (transient, dec.cache_nbytes())
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    dec.next()  # a decode step of the three rows
    transient = mx.get_peak_memory() - max(before, mx.get_active_memory())
    assert transient < dec.cache_nbytes() // LAYERS, (transient, dec.cache_nbytes())
    dec.close()


def _state(tokens: int, source: mx.array | None = None) -> list[Any]:
    """A 4-layer KV state of ``tokens`` tokens: evaluated, or a lazy slice of ``source``
    (as the scheduler's states are of the batch's buffer)."""
    out = []
    for i in range(4):
        c = KVCache()
        if source is None:
            c.keys = mx.random.normal((1, 4, tokens, 64))
            c.values = c.keys + 1
            mx.eval(c.keys, c.values)
        else:
            c.keys = mx.contiguous(source[i:i + 1, :, :tokens])
            c.values = mx.contiguous(source[i + 4:i + 5, :, :tokens])
        c.offset = tokens
        out.append(c)
    return out


def test_the_prefix_cache_makes_room_before_copying_a_state(quiet: None) -> None:
    one = sum(c.nbytes for c in _state(1000))
    pc = PrefixCache(max_bytes=one * 3 // 2)  # one state fits, two do not
    pc.insert(list(range(1000)), _state(1000))
    buffer = mx.random.normal((8, 4, 1000, 64))  # a batch's buffer the next state slices
    mx.eval(buffer)
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pc.insert(list(range(5000, 6000)), _state(1000, buffer))
    assert pc.nbytes == one  # the first state was evicted for the second
    # the first was let go before the second was copied: never both at once
    assert mx.get_peak_memory() - before < one // 4


def test_a_state_larger_than_the_cache_is_not_copied_and_evicts_nothing(quiet: None) -> None:
    small = sum(c.nbytes for c in _state(500))
    pc = PrefixCache(max_bytes=small * 3)
    pc.insert(list(range(500)), _state(500))
    buffer = mx.random.normal((8, 4, 4000, 64))
    mx.eval(buffer)
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pc.insert(list(range(7000, 11000)), _state(4000, buffer))  # 8x the small one
    assert mx.get_peak_memory() - before < small // 4
    assert pc.nbytes == small and pc.peek(list(range(500))) >= 499
