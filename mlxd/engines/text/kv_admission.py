"""Admission by live KV: a model's running sequences never hold more KV than the budget leaves.

Every running sequence is counted in tokens. It *holds* its prompt plus what it has
generated so far; it is *granted* what it is expected to hold: its prompt plus its
output limit, or, when that limit is only "the rest of the context" (the request asked
for none and the server has no default), its prompt plus ``--kv-output-estimate``
tokens (1024). A sequence that reaches its grant asks for ``GROW_TOKENS`` more before
its next token;
when the grants would then exceed the allowance, the newest sequences are preempted
(the scheduler moves their KV to the prefix cache and requeues them). A sequence left
alone that still cannot grow ends with ``finish_reason: length``: memory, like the
context, is where it stops.

Bytes are tokens x ``bytes_per_token`` (K and V of every attention layer at the cache's
dtype). The allowance is the memory budget less what other models hold (read from the
``ModelManager`` through the worker's ``budget`` callback), this model's weights, its
prefix cache's cap and its transient reserve (``models/memory.py``'s
``text_transient_bytes``: what one step holds beyond the live KV). A request whose
prompt and output limit exceed the allowance with no other model loaded can never run:
it is refused at once with the numbers.

The counts are the scheduler's own, in the batch's layout: mlx-lm keeps every row of a
batch as long as the longest (left padding), so the grants hold rows x the longest grant
(``batch_footprint``), and that is what admission and growth check against the
allowance and what ``granted_bytes`` reports. The buffer's rounding up to 256 tokens
(``Decoder.cache_nbytes`` reports those bytes) is left to the static KV reserve of the
model's estimate and the margin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mlxd.engines.text.input_processor import PreparedPrompt
from mlxd.engines.text.quantized_cache import KVQuantization
from mlxd.errors import InvalidRequest
from mlxd.models.engine import KVStats
from mlxd.models.memory import kv_bytes_per_token

# Output tokens a request without an output limit is expected to generate (``--kv-output-
# estimate``; it may grow past it, GROW_TOKENS at a time, while memory allows).
OUTPUT_ESTIMATE = 1024
GROW_TOKENS = 256


@dataclass(frozen=True)
class HeldBeside:
    """What a model holds beside its sequences' KV, under the same budget."""

    weights: int
    prefix_cache: int  # the prefix cache's cap
    transient: int  # what one step holds beyond the live KV (text_transient_bytes)

    @property
    def total(self) -> int:
        return self.weights + self.prefix_cache + self.transient


class KVLedger:
    """Grants of KV per running sequence, against an allowance (worker thread; ``stats``
    from any thread)."""

    def __init__(self, bytes_per_token: int, budget: Callable[[], tuple[int, int]],
                 own_bytes: Callable[[], HeldBeside],
                 output_estimate: int = OUTPUT_ESTIMATE) -> None:
        self.bytes_per_token = max(1, bytes_per_token)
        self.output_estimate = max(1, output_estimate)
        self._budget = budget  # (budget, bytes other models hold)
        self._own = own_bytes  # this model's weights, prefix cache cap and transient reserve
        self._grants: dict[str, int] = {}  # seq_id -> granted tokens
        self._held: dict[str, int] = {}  # seq_id -> held tokens at the last check
        self._lock = threading.Lock()
        self.peak_live_tokens = 0
        self.preemptions = 0
        self.waiting_for_memory = 0
        self._allowance = 0

    # -- allowances ---------------------------------------------------------
    def allowance_alone(self) -> int:
        """KV bytes this model may hold with no other model loaded."""
        budget, _ = self._budget()
        return max(0, budget - self._own().total)

    def allowance(self) -> int:
        """KV bytes this model may hold beside the other models loaded now."""
        budget, others = self._budget()
        self._allowance = max(0, budget - others - self._own().total)
        return self._allowance

    @property
    def transient_bytes(self) -> int:
        return self._own().transient

    # -- per request --------------------------------------------------------
    def refuse_never_fitting(self, prompt: PreparedPrompt) -> None:
        """400 for a request that could not run even alone: its prompt and output limit
        (one token when the limit is only the rest of the context) exceed the allowance."""
        n_prompt = len(prompt.tokens)
        output = 1 if prompt.context_limited else prompt.max_tokens
        tokens = n_prompt + output
        budget, _ = self._budget()
        own = self._own()
        allowance = max(0, budget - own.total)
        if tokens * self.bytes_per_token <= allowance:
            return
        raise InvalidRequest(
            f"This request needs KV memory for {tokens} tokens ({n_prompt} prompt + {output} "
            f"output) x {self.bytes_per_token} bytes per token = "
            f"{tokens * self.bytes_per_token} bytes, more than this model's KV allowance of "
            f"{allowance} bytes (memory budget {budget} less its weights {own.weights}, "
            f"prefix cache {own.prefix_cache} and transient reserve {own.transient}). "
            f"Shorten the prompt, lower max_tokens, or raise --memory-budget.",
            param="max_tokens" if not prompt.context_limited else "messages",
            code="kv_memory_exceeded")

    def need(self, n_prompt: int, generated: int, max_tokens: int, context_limited: bool) -> int:
        """Tokens a sequence is expected to hold, from where it stands. Without an output
        limit of its own, never more than the allowance alone holds (it grows from there)."""
        held = n_prompt + generated
        remaining = max(0, max_tokens - generated)
        if not context_limited:
            return held + remaining
        remaining = min(remaining, max(self.output_estimate - generated, GROW_TOKENS))
        alone = self.allowance_alone() // self.bytes_per_token
        return max(held + 1, min(held + remaining, alone))

    def admit(self, seq_id: str, need: int) -> bool:
        """Grant ``need`` tokens if they fit beside the grants running now, every row
        padded to the longest (``batch_footprint``)."""
        with self._lock:
            grants = [*self._grants.values(), need]
        if batch_footprint(grants) * self.bytes_per_token > self.allowance():
            return False
        with self._lock:
            self._grants[seq_id] = need
        return True

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._grants.pop(seq_id, None)
            self._held.pop(seq_id, None)

    def grow(self, running: Iterable[tuple[str, float, int, int, bool]]
             ) -> tuple[list[str], list[str]]:
        """Before a step: every sequence's next token must fit its grant. ``running`` is
        (seq_id, submitted_at, held tokens after this step, most tokens it may hold,
        whether it can be preempted and resumed). Returns (preempted, ended): sequences
        to move out, newest first, so that the others' grants fit, and sequences that
        cannot grow with nothing left to preempt (they end at length)."""
        rows = sorted(running, key=lambda r: r[1])  # oldest first
        allowance = self.allowance() // self.bytes_per_token
        preempted: list[str] = []
        ended: list[str] = []
        with self._lock:
            for seq_id, _, held, _, _ in rows:
                self._held[seq_id] = held
            for seq_id, _, held, most, _ in rows:
                if seq_id in preempted or held <= self._grants.get(seq_id, 0):
                    continue
                want = max(held, min(held + GROW_TOKENS, most))
                while self._footprint_with(seq_id, want) > allowance:
                    newest = [r[0] for r in reversed(rows) if r[4] and r[0] not in preempted
                              and r[0] in self._grants]
                    if not newest:
                        break  # nothing left to preempt
                    victim = newest[0]
                    preempted.append(victim)
                    self._grants.pop(victim, None)
                    self._held.pop(victim, None)
                    if victim == seq_id:
                        break
                if seq_id in preempted:
                    continue
                if self._footprint_with(seq_id, want) > allowance:
                    others = [g for k, g in self._grants.items() if k != seq_id]
                    n_rows = len(others) + 1
                    # the most it may hold: an equal share, if the others fit in theirs
                    want = allowance // n_rows \
                        if n_rows * max(others, default=0) <= allowance else 0
                    if want < held:
                        ended.append(seq_id)
                        self._held.pop(seq_id, None)
                        continue
                self._grants[seq_id] = want
            live = sum(self._held.values())
            self.peak_live_tokens = max(self.peak_live_tokens, live)
        self.preemptions += len(preempted)
        return preempted, ended

    def _footprint_with(self, seq_id: str, want: int) -> int:
        """The batch's footprint in tokens with ``seq_id`` granted ``want`` (lock held)."""
        return batch_footprint([*(g for k, g in self._grants.items() if k != seq_id), want])

    def granted_bytes(self) -> int:
        """What the grants hold in the batch, rows padded to the longest."""
        with self._lock:
            return batch_footprint(self._grants.values()) * self.bytes_per_token

    def stats(self) -> KVStats:
        with self._lock:
            live = sum(self._held.values())
            granted = batch_footprint(self._grants.values())
        bpt = self.bytes_per_token
        return KVStats(live_bytes=live * bpt, granted_bytes=granted * bpt,
                       peak_live_bytes=self.peak_live_tokens * bpt,
                       allowance_bytes=self._allowance, preemptions=self.preemptions,
                       waiting_for_memory=self.waiting_for_memory,
                       bytes_per_token=bpt, transient_bytes=self.transient_bytes)


def batch_footprint(grants: Iterable[int]) -> int:
    """Tokens of KV a batch holds when each sequence holds its grant: mlx-lm keeps the
    running rows in one buffer per layer, each left-padded to the longest, so the batch
    holds rows x the longest grant (a 2,000-token row beside a 2,900-token one holds
    2,900). Rows still prefilling are padded the same way among themselves."""
    grants = list(grants)
    return len(grants) * max(grants) if grants else 0


def cache_dtype_bytes(model: Any) -> int:
    """Bytes of one KV element: the model's floating-point parameters' dtype (a quantized
    model's scales carry the dtype its activations, and so its KV cache, run in)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for item in tree_flatten(model.parameters()):
        value = item[1]
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return int(value.dtype.size)
    return 4


def kv_ledger(model: Any, config: dict[str, Any], budget: Callable[[], tuple[int, int]] | None,
              own_bytes: Callable[[], HeldBeside],
              output_estimate: int = OUTPUT_ESTIMATE,
              quantized: KVQuantization | None = None) -> KVLedger | None:
    """The ledger of a model served under a memory budget (None without one). Bytes per
    token count K and V of every layer (a hybrid's recurrent layers are counted as
    attention: an over-estimate), quantized ones at their bits, scales and biases."""
    if budget is None:
        return None
    bits, group = (quantized.bits, quantized.group_size) if quantized else (None, 64)
    per_token = kv_bytes_per_token(config, cache_dtype_bytes(model), bits, group)
    return KVLedger(per_token, budget, own_bytes, output_estimate) if per_token else None
