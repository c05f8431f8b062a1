"""Keep a finished answer's KV state in the vision prefix cache, for the next turn.

mlx-vlm's prefix cache (``mlx_vlm.apc``) stores a prompt's KV blocks when its
prefill ends, but not the tokens generated after it. Turn 2 of a conversation
about an image repeats turn 1's prompt *and* turn 1's answer, so without the
answer's blocks turn 2 prefills the whole answer again (64 tokens of a
64-token answer: about as much work as turn 1's text). Here, when a sequence
leaves mlx-vlm's generation batch (finished, stopped or cancelled), its row of
the batch KV cache — prompt plus every token fed so far — is stored as blocks
under the same salt as its prompt (model, media hashes, cache salt), as mlxd's
text prefix cache stores prompt plus answer. Blocks are keyed by the exact
token ids, so a turn 2 whose re-encoded answer differs only reuses up to the
first differing block.

The hook is an instance attribute on mlx-vlm's ``GenerationBatch`` (its
``filter``), set by the generator subclass in ``vlm_decoder``; anything that
does not match what is expected (KV length against the token count) stores
nothing, so the worst case is a miss, never a wrong prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mlxd.engines.upstream import mlx_vlm as vlm_internals

log = logging.getLogger(__name__)

_MARK = "_mlxd_keeps_answers"


class AnswerKeeper:
    """The rows whose KV state is stored when they leave the generation batch."""

    def __init__(self) -> None:
        # uid -> (the row's token list, prompt then generated (shared, grows), salt)
        self.rows: dict[int, tuple[list[int], int]] = {}
        self.stored_blocks = 0  # blocks stored from answers (counted for tests/stats)

    def track(self, uid: int, tokens: list[int], salt: int) -> None:
        self.rows[uid] = (tokens, salt)

    def forget(self, uid: int) -> None:
        self.rows.pop(uid, None)

    def watch(self, batch: Any, manager: Any) -> None:
        """Store each row of ``batch`` that ``filter`` drops (once per batch object)."""
        if manager is None or getattr(batch, _MARK, False) or not hasattr(batch, "filter"):
            return
        original: Callable[[list[int]], None] = batch.filter

        def filter(keep: list[int]) -> None:
            kept = set(keep)
            for idx in range(len(batch.uids)):
                if idx not in kept:
                    self._store(batch, idx, manager)
            original(keep)

        batch.filter = filter
        setattr(batch, _MARK, True)

    def _store(self, batch: Any, idx: int, manager: Any) -> None:
        entry = self.rows.pop(int(batch.uids[idx]), None)
        if entry is None:
            return
        try:
            ids = fed_tokens(batch, idx, entry[0])
            if ids is None:
                return
            from mlx_vlm import apc

            blocks = apc.harvest_blocks_from_batch_cache(
                manager, batch.prompt_cache, ids, batch_idx=idx, extra_hash=entry[1])
            self.stored_blocks += len(blocks)
            manager.release(blocks)
        except Exception as e:  # best effort: a failed store is a later miss
            log.debug("storing an answer's KV blocks failed: %s", e)


def fed_tokens(batch: Any, idx: int, tokens: list[int]) -> list[int] | None:
    """The token ids whose KV row ``idx`` of ``batch`` holds, or None when unsure.

    Every token mlx-vlm returns was fed in the step that returned it, so the row holds
    the prompt and all returned tokens; inside ``next`` the current step's token is not
    yet in ``tokens`` (the decoder appends it after ``next`` returns).
    """
    from mlx_vlm.apc import layer_kv_for_apc

    if not batch.prompt_cache:
        return None
    keys, _ = layer_kv_for_apc(batch.prompt_cache[0], batch_idx=idx)
    if keys is None:
        return None
    length = int(keys.shape[2])
    # a speculating batch knows each row's tokens in its cache (a verify step feeds several)
    known = getattr(batch, "cached_tokens", None)
    ids = known(idx) if callable(known) else None
    if ids is not None and len(ids) == length:
        return ids
    ids = list(tokens)
    current = vlm_internals.current_tokens(batch)
    if len(ids) == length - 1 and current is not None:
        ids.append(int(current[idx].item()))
    if len(ids) != length:
        return None
    return ids
