"""mlx-lm's internals, behind one seam.

mlxd decodes through mlx-lm's ``BatchGenerator`` and keeps prefixes in its
``LRUPromptCache``; a few things it needs have no public API. This module is the
one place that reads or writes them from outside mlx-lm's own classes, and
``PRIVATE`` lists every private name mlxd uses, those its subclasses
(``SpeculativeBatch``, ``GappedBatchKVCache``, ``QuantizedBatchKVCache``) inherit
included, and the public ones whose behaviour ``settle_joins`` wraps.
``tests/test_upstream_adapters.py`` checks each on the installed version; a model
load runs ``ADAPTER.require`` (see ``upstream/versions.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlxd.engines.upstream.versions import Adapter, Private

_GEN = "mlx_lm.generate"
_CACHE = "mlx_lm.models.cache"
_SPEC = "engines/text/speculative.py: SpeculativeBatch"

PRIVATE = (
    Private(_GEN, "BatchGenerator", "_generation_batch", "attribute",
            "engines/text/speculative.py: install() puts a SpeculativeBatch in its place"),
    Private(_GEN, "BatchGenerator", "_prompt_batch", "attribute",
            "engines/text/lora.py: route_rows() puts a batch that names its adapter rows"),
    Private(_GEN, "GenerationBatch", "_next_tokens", "attribute",
            f"{_SPEC} and draft.py: the rows' pending tokens"),
    Private(_GEN, "GenerationBatch", "_next_logprobs", "attribute", _SPEC),
    Private(_GEN, "GenerationBatch", "_num_tokens", "attribute",
            f"{_SPEC} and draft.py: tokens generated per row"),
    Private(_GEN, "GenerationBatch", "_token_context", "attribute", _SPEC),
    Private(_GEN, "GenerationBatch", "_matchers", "attribute", f"{_SPEC}: stop sequences"),
    Private(_CACHE, "BatchKVCache", "_idx", "attribute",
            "engines/text/gapped_cache.py and quantized_cache.py: the batch's write position"),
    Private(_CACHE, "BatchKVCache", "_right_padding", "attribute",
            "engines/text/gapped_cache.py and quantized_cache.py: finalize"),
    Private(_CACHE, "LRUPromptCache", "_trie", "attribute",
            "engines/text/prefix_cache.py: peek and entries"),
    Private(_CACHE, "LRUPromptCache", "_lru", "attribute",
            "engines/text/prefix_cache.py: entries, least recently used first"),
    Private(_CACHE, "LRUPromptCache.CacheOrder", "_lrus", "attribute",
            "engines/text/prefix_cache.py: entries, least recently used first"),
    Private("mlx_lm.tokenizer_utils", "TokenizerWrapper", "_tokenizer", "attribute",
            "engines/text/engine.py: the Hugging Face tokenizer behind the wrapper"),
    # public, but settle_joins (below) wraps them and relies on what they do
    Private(_GEN, "PromptProcessingBatch", "split", "method",
            "settle_joins: the rows whose prefill ended leave the prompt batch", ("indices",)),
    Private(_GEN, "GenerationBatch", "extend", "method",
            "settle_joins: joining rows are concatenated into the running batch", ("batch",)),
    Private(_GEN, "GenerationBatch", "prompt_cache", "attribute",
            "settle_joins: each layer's cache of the running batch"),
    Private(_GEN, "PromptProcessingBatch", "prompt_cache", "attribute",
            "settle_joins: each layer's cache of the prompt batch"),
)

ADAPTER = Adapter("mlx-lm", ("0.32.2",), PRIVATE)


def generation_batch(gen: Any) -> Any:
    """The ``GenerationBatch`` a ``BatchGenerator`` decodes."""
    return gen._generation_batch


def replace_generation_batch(gen: Any, batch: Any) -> None:
    """Make ``gen`` decode through ``batch`` (before any sequence has joined)."""
    gen._generation_batch = batch


def prompt_batch(gen: Any) -> Any:
    """The ``PromptProcessingBatch`` a ``BatchGenerator`` prefills through."""
    return gen._prompt_batch


def replace_prompt_batch(gen: Any, batch: Any) -> None:
    """Make ``gen`` prefill through ``batch`` (before any sequence has joined)."""
    gen._prompt_batch = batch


def pending_tokens(batch: Any) -> Any:
    """The token each row of a ``GenerationBatch`` feeds next (an ``mx.array``)."""
    return batch._next_tokens


def generated_counts(batch: Any) -> list[int]:
    """How many tokens each row of a ``GenerationBatch`` has generated."""
    return list(batch._num_tokens)


def write_position(cache: Any) -> int:
    """Where a ``BatchKVCache`` writes its next step (its padded length)."""
    return int(cache._idx)


def prompt_trie(cache: Any) -> Any:
    """The ``PromptTrie`` of an ``LRUPromptCache`` (``search``, ``get``)."""
    return cache._trie


def lru_entries(cache: Any) -> Iterator[tuple[Any, Any]]:
    """(namespace, tokens) of every ``LRUPromptCache`` entry, least recently used first
    within each of its orders."""
    for order in cache._lru._lrus.values():
        yield from order


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind mlx-lm's ``TokenizerWrapper`` (or ``tokenizer``
    itself when it is not wrapped)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def settle_joins(gen: Any) -> None:
    """Make the copies rows joining ``gen``'s running batch cost one layer at a time.

    A prompt whose prefill ends moves from the prompt batch to the running batch: mlx-lm
    gathers the moving rows and the staying ones into new buffers
    (``PromptProcessingBatch.split``, then ``filter``), and concatenates every layer of
    the running batch with the moving rows (``GenerationBatch.extend``), all lazily. The
    evaluation that follows (a forward, a prefix-cache copy) builds every layer's new
    buffers while every old one is still held: a second copy of the rows that move, or
    of the whole batch. Evaluated layer by layer right away, and each layer of the moving
    rows let go of once concatenated, each old buffer is freed before the next layer's
    copy is made. Wraps the two methods of this generator's
    batches (after any other code replaced the batches); undone with the generator."""
    import mlx.core as mx

    prompts, running = prompt_batch(gen), generation_batch(gen)
    split, extend = prompts.split, running.extend

    def settled_split(indices: Any) -> Any:
        moving = split(indices)
        layers = max(len(prompts.prompt_cache), len(moving.prompt_cache))
        for i in range(layers):
            for batch in (prompts, moving):
                if i < len(batch.prompt_cache):
                    mx.eval(batch.prompt_cache[i].state)
        return moving

    def settled_extend(other: Any) -> None:
        extend(other)
        # the joining batch's own layers, read by nothing once concatenated (none to drop
        # when the running batch was empty and simply took them over)
        moved = other.prompt_cache if other.prompt_cache is not running.prompt_cache else []
        for i, cache in enumerate(running.prompt_cache):
            mx.eval(cache.state)
            if i < len(moved):
                moved[i] = None  # free the moving rows' copy of this layer now

    prompts.split = settled_split
    running.extend = settled_extend
