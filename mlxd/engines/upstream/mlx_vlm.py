"""mlx-vlm's internals, behind one seam.

Vision models decode through mlx-vlm's ``BatchGenerator`` and keep prefixes in its
``APCManager``. This module is the one place that reads their private state from
outside mlx-vlm's classes, and ``PRIVATE`` lists every private name mlxd uses, those
its subclasses (``MediaKeyedGenerator``, ``CountingAPCManager`` in
``engines/vision/decoder.py``, ``SpeculativeVLMBatch`` in ``engines/vision/speculative.py``)
override or inherit included. The llava patches
(``engines/vision/patches/``) carry their own version table and self-checks.
``tests/test_upstream_adapters.py`` checks each name on the installed version; a model
load runs ``ADAPTER.require`` (see ``upstream/versions.py``).
"""

from __future__ import annotations

from typing import Any

from mlxd.engines.upstream.versions import Adapter, Private

_AR = "mlx_vlm.generate.ar"
_DECODER = "engines/vision/decoder.py"
_SPEC = "engines/vision/speculative.py: SpeculativeVLMBatch"

PRIVATE = (
    Private(_AR, "BatchGenerator", "_generation_batch", "attribute",
            f"{_DECODER}: free slots, resident cache bytes"),
    Private(_AR, "BatchGenerator", "_unprocessed_sequences", "attribute",
            f"{_DECODER}: how many prompts wait for a prefill"),
    Private(_AR, "BatchGenerator", "_prompt_tokens_counter", "attribute",
            f"{_DECODER}: prompt tokens per step, for the stats"),
    Private(_AR, "BatchGenerator", "_extend_generation_batch", "method",
            f"{_DECODER}: MediaKeyedGenerator reads new rows' first tokens", ("gen_batch",)),
    Private(_AR, "BatchGenerator", "_apc_prefix_has_media_tokens", "method",
            f"{_DECODER}: MediaKeyedGenerator reuses prefixes with images",
            ("ids_list", "prefix_len")),
    Private(_AR, "GenerationBatch", "_next_tokens", "attribute",
            f"{_DECODER}: the first token of each row that joins; {_SPEC}: pending tokens"),
    Private(_AR, "GenerationBatch", "_current_tokens", "attribute",
            "engines/vision/turns.py: the token in flight when an answer is stored; "
            f"{_SPEC} sets it to the tokens a verify step fed"),
    Private(_AR, "GenerationBatch", "_current_lps", "attribute", _SPEC),
    Private(_AR, "GenerationBatch", "_next_lps", "attribute", _SPEC),
    Private(_AR, "GenerationBatch", "_num_tokens", "attribute",
            f"{_SPEC}: tokens generated per row (max_tokens)"),
    Private(_AR, "GenerationBatch", "_rope_deltas", "attribute",
            f"{_SPEC}: each row's M-RoPE position delta, passed to the verify forward"),
    Private(_AR, "GenerationBatch", "_language_model", "attribute",
            f"{_SPEC}: the model a verify step runs"),
    Private(_AR, "GenerationBatch", "_ensure_token_context", "method",
            f"{_SPEC}: the processors' context before a verify step appends to it"),
    Private(_AR, "", "_apc_semantic_hash", "key",
            f"{_DECODER}: each prompt's media salt for the prefix cache"),
    Private("mlx_vlm.apc", "APCManager", "_resident_bytes_locked", "method",
            f"{_DECODER}: CountingAPCManager counts bytes without re-measuring", ()),
    Private("mlx_vlm.apc", "APCManager", "_exact_cache", "attribute",
            f"{_DECODER}: CountingAPCManager adds its entries' bytes"),
)

ADAPTER = Adapter("mlx-vlm", ("0.7.10",), PRIVATE)


def generation_batch(gen: Any) -> Any:
    """The ``GenerationBatch`` a ``BatchGenerator`` decodes."""
    return gen._generation_batch


def waiting_prompts(gen: Any) -> int:
    """How many prompts a ``BatchGenerator`` holds for a prefill."""
    return len(gen._unprocessed_sequences)


def prompt_tokens_processed(gen: Any) -> int:
    """Prompt tokens a ``BatchGenerator`` has prefilled so far."""
    return int(gen._prompt_tokens_counter)


def pending_tokens(batch: Any) -> Any:
    """The token each row of a ``GenerationBatch`` feeds next (None when empty)."""
    return getattr(batch, "_next_tokens", None)


def current_tokens(batch: Any) -> Any:
    """The tokens a ``GenerationBatch`` is feeding in this step (None before the first)."""
    return getattr(batch, "_current_tokens", None)
