"""Admission that waits for a prefix another prompt is prefilling right now.

Concurrent agent sessions start with the same long system prompt and tools.
Admitted together, each would prefill that prefix itself. A prompt whose prefix
a running prompt is prefilling waits (stays queued) until that prefill reaches
the point where a state it can resume from is stored in the prefix cache: the
end of that prompt for attention models (the cache trims it back to the shared
part), its system-prompt checkpoint for hybrid models (a recurrent state cannot
be trimmed). Then it is admitted and resumes from that state.

On a compute-bound device the wait costs the waiting prompt little: the two
prefills would share the same compute anyway, and the shared tokens are now
processed once. A prompt only waits when the tokens it saves are at least
``MIN_SAVED_TOKENS`` and at least half of the prefill it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mlxd.engines.text.input_processor import PreparedPrompt
    from mlxd.engines.text.prefix_cache import PrefixCache

MIN_SAVED_TOKENS = 256


class Sequence(Protocol):
    """What admission reads of a scheduler's sequence (``scheduler.Sequence``; named
    here so the scheduler imports this module and not the reverse)."""

    prompt: PreparedPrompt
    cache_key: str | None
    pipeline: Any  # its ``completion_tokens``: 0 while the prompt is prefilling
    n_cached: int
    prefilled: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect (list slices compare in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _reuse_point(peer: Sequence, shared: int, n_tokens: int, untrimmable: bool
                 ) -> tuple[int, int] | None:
    """(where ``peer``'s prefill stores a state a prompt sharing ``shared`` of its
    ``n_tokens`` tokens with it can resume from, how many tokens that state covers)."""
    if untrimmable:  # only a checkpoint inside the shared part is of use
        points = [c for c in peer.prompt.checkpoints if c <= shared]
        return (max(points), max(points)) if points else None
    # the state stored at the end of the peer's prompt, trimmed to the shared part
    return len(peer.prompt.tokens), min(shared, n_tokens - 1)


def waits_for_peer(seq: Sequence, running: Iterable[Sequence], cache: PrefixCache | None,
                   untrimmable: bool) -> bool:
    """Whether ``seq`` should stay queued until a running prompt's prefill has stored
    the prefix they share (see the module docstring)."""
    if cache is None or cache.max_bytes <= 0:
        return False
    tokens = seq.prompt.tokens
    namespace = cache.namespace(seq.prompt.media_hashes, seq.prompt.cache_salt)
    have: int | None = None
    for peer in running:
        if peer.cache_key != namespace or peer.pipeline.completion_tokens:
            continue  # another namespace, or done prefilling
        shared = common_prefix(peer.prompt.tokens, tokens)
        if shared < MIN_SAVED_TOKENS:
            continue
        point = _reuse_point(peer, shared, len(tokens), untrimmable)
        if point is None or peer.prefilled >= point[0]:
            continue  # nothing to wait for: the state is stored (or never will be)
        if have is None:
            have = cache.peek(tokens, namespace)
        saved = point[1] - have
        if saved >= MIN_SAVED_TOKENS and 2 * saved >= point[0] - peer.prefilled:
            return True
    return False


def track_prefill(prompt_responses: list[Any], running: Mapping[int, Sequence]) -> None:
    """Record how far each running prompt's prefill got (the decoder's progress)."""
    for r in prompt_responses:
        seq = running.get(r.uid)
        progress = getattr(r, "progress", None)
        if seq is not None and progress:
            seq.prefilled = seq.n_cached + int(progress[0])
