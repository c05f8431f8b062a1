"""Prompt-lookup speculation inside mlx-vlm's generation batch (vision-language models).

The text scheduler's speculation (``engines/text/speculative.py``) lives in a
subclass of mlx-lm's ``GenerationBatch``; vision models decode through mlx-vlm's
own ``GenerationBatch``, so this is its counterpart there, built from the same
parts: ``PromptLookup`` drafts from n-grams of a row's own prompt and output
(the image placeholder tokens included: they never match text), ``RowState``
adapts each row's draft length and backs off a row whose drafts fail, and
``verify_width`` decides whether a wider forward pays for the drafts.

A verify step runs the language model once over ``[pending, d1..dK]`` for every
row (shorter drafts padded), samples every position as a plain step would, and
keeps each row's drafts while they equal the token sampled before them ("sample,
then compare", as the text path does): at temperature 0 the output is the one a
plain step-by-step decode gives, token for token, and a sampled row accepts a
draft with the probability its sampler gives it, so sampling keeps its
distribution. Rows that sample, take logits processors or want log-probabilities
carry the decoder's ``RowSampler`` processor: it runs at each drafted position
with the context a plain step would have had there (grammars and penalties see
the drafts before it; the grammar matcher rolls back what was rejected), and its
``rollback`` forgets the log-probabilities of the positions that were rejected.
A processor without ``rollback`` keeps its row from drafting.

Positions. Qwen2-VL-style models (M-RoPE) place a row's text after its image by
a per-row ``rope_deltas`` that mlx-vlm keeps on the batch; the language model adds
it to each row's cache offset, and a forward over several tokens numbers them
from there. So the verify forward passes the batch's deltas as a plain step
does, and the rewind moves each row's offset back by what it rejected: the next
tokens take the positions they would have had. The deltas themselves do not
change (they are the image's, fixed at prefill).

Rewind. Every row wrote ``1 + width`` positions. What all rows rejected is
trimmed; a row that rejected more is shifted right by the difference
(``prepare(right_padding=...)`` then ``finalize``: the row's rejected tail rolls
out past the write position and its left padding grows), which copies that
row's keys and values once. Only models whose every layer is a plain batched KV
cache can do this: sliding-window (rotating) caches and recurrent states cannot
be rewound exactly, and a model whose text attention is bidirectional
(PaliGemma) would let drafts see the tokens after them, so those models decode
without speculation, said once in the log at load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_vlm.generate.ar import GenerationBatch
from mlx_vlm.models import cache as vlm_cache

from mlxd.engines.text.speculative import (
    FIRST_DRAFT_TOKENS,
    PRIOR_ACCEPTANCE,
    RATE_RECOVERY,
    PromptLookup,
    RowState,
    SpecCounts,
    SpeculativeOptions,
    verify_width,
)

log = logging.getLogger(__name__)


def rewindable(language_model: Any) -> str | None:
    """Why ``language_model``'s batched caches cannot be rewound after a rejected draft
    (None: every layer becomes a plain ``BatchKVCache``, which can), or why a forward over
    several tokens is not the same as one token at a time (PaliGemma's text attends both
    ways by default).

    mlx-vlm batches a layer's ``KVCache`` as a ``BatchKVCache``; a model without
    ``make_cache`` gets one per layer. Anything else (rotating windows, recurrent
    states, a model-specific batch cache) is refused.
    """
    config = getattr(language_model, "config", None) or getattr(language_model, "args", None)
    if getattr(config, "use_bidirectional_attention", False):
        return "its text attention is bidirectional (drafts would see the tokens after them)"
    make = getattr(language_model, "make_cache", None)
    if make is None:
        return None
    kinds = {type(c).__name__ for c in make() if type(c) is not vlm_cache.KVCache}
    return (f"its caches include {', '.join(sorted(kinds))}, which cannot drop a rejected "
            "draft" if kinds else None)


@dataclass
class Speculation:
    """One decoder's drafting state: options, each row's tokens and drafting state, and
    the draft counts (per row until read, and in total)."""

    options: SpeculativeOptions
    rows: dict[int, RowState] = field(default_factory=dict)
    counts: dict[int, SpecCounts] = field(default_factory=dict)
    totals: SpecCounts = field(default_factory=SpecCounts)
    verify_steps: int = 0

    def track(self, uid: int, prompt: Sequence[int]) -> None:
        """A row joins: its tokens so far are its prompt (all of it is in the KV cache by
        the time it decodes)."""
        opts = self.options
        self.rows[uid] = RowState(PromptLookup(list(prompt), opts.ngram_min, opts.ngram_max),
                                  k=min(FIRST_DRAFT_TOKENS, opts.num_draft_tokens))

    def forget(self, uid: int) -> None:
        self.rows.pop(uid, None)

    def fed(self, uid: int, tokens: Sequence[int]) -> None:
        """``tokens`` entered the row's KV cache."""
        state = self.rows.get(uid)
        if state is not None:
            state.lookup.tokens.extend(tokens)

    def account(self, uid: int, drafted: int, accepted: int) -> None:
        state = self.rows.get(uid)
        if state is not None:
            state.update(drafted, accepted, self.options.num_draft_tokens)
        counts = self.counts.setdefault(uid, SpecCounts())
        counts.accepted += accepted
        counts.rejected += drafted - accepted
        self.totals.accepted += accepted
        self.totals.rejected += drafted - accepted

    def pop_counts(self, uids: Sequence[int]) -> dict[int, SpecCounts]:
        return {u: self.counts.pop(u) for u in uids if u in self.counts}


class SpeculativeVLMBatch(GenerationBatch):  # type: ignore[misc]
    """mlx-vlm's ``GenerationBatch`` plus in-batch verification of prompt-lookup drafts.

    The generator makes a fresh ``GenerationBatch`` for every prefill and keeps it or
    joins it to the running one, so the decoder turns the running batch into this class
    in place (``adopt``); the drafting state lives in the decoder's ``Speculation``.
    """

    speculation: Speculation

    @classmethod
    def adopt(cls, batch: Any, speculation: Speculation) -> None:
        if not isinstance(batch, cls):
            batch.__class__ = cls
        batch.speculation = speculation

    def cached_tokens(self, idx: int) -> list[int] | None:
        """The tokens row ``idx``'s KV cache holds, as far as speculation tracked them (a
        row that finished in a plain step lacks that step's token: its caller checks the
        length)."""
        state = self.speculation.rows.get(self.uids[idx])
        return list(state.lookup.tokens) if state is not None else None

    # -- planning ------------------------------------------------------------
    def _drafting_rows(self) -> list[int]:
        """Rows that may draft this step: plain greedy rows whose context recurs."""
        if self.compute_logprobs or self.top_logprobs_k or any(
                c is not None for c in self.thinking_budget_criteria):
            return []
        if not all(type(c) is vlm_cache.BatchKVCache for c in self.prompt_cache):
            return []
        processors = self.logits_processors or []
        rows = self.speculation.rows
        return [i for i, uid in enumerate(self.uids)
                if (i >= len(processors) or all(callable(getattr(p, "rollback", None))
                                                for p in processors[i] or ()))
                and uid in rows and rows[uid].ready()]

    def _plan(self) -> tuple[list[int], list[list[int]]] | None:
        """(pending tokens, each row's drafts) for a verify step, or None for a plain one."""
        spec = self.speculation
        opts = spec.options
        batch = len(self.uids)
        budget = opts.max_verify_tokens // batch - 1
        if budget < 1 or self._next_tokens is None:
            return None
        candidates = self._drafting_rows()
        if not candidates:
            return None
        mx.eval(self._next_tokens)
        pending = [int(t) for t in cast(list[int], self._next_tokens.tolist())]
        drafts: list[list[int]] = [[] for _ in range(batch)]
        for i in candidates:
            state = spec.rows[self.uids[i]]
            k = min(state.k, budget, self.max_tokens[i] - self._num_tokens[i] - 1)
            if k <= 0:
                continue
            draft = state.lookup.draft(pending[i], k)
            for j, tok in enumerate(draft):
                if tok in opts.stop_ids:
                    draft = draft[:j]
                    break
            drafts[i] = draft
        if not any(drafts):
            return None
        states = [spec.rows.get(u) for u in self.uids]
        rates = [s.rate if s is not None else 0.0 for s in states]
        m = verify_width([len(d) for d in drafts], rates, opts.cost())
        if not m:  # not worth a wider forward now; the rates drift back to try again
            for row, draft in zip(states, drafts):
                if draft and row is not None:
                    row.rate += RATE_RECOVERY * (PRIOR_ACCEPTANCE - row.rate)
            return None
        return pending, [d[:m] for d in drafts]

    # -- one verify step -----------------------------------------------------
    def _forward(self, inputs: mx.array, drafts: list[list[int]]) -> mx.array:
        """Log-probabilities at every position of ``inputs``. A row's processors run at
        its pending token and at each of its drafts, each time with the context a plain
        step would have had there (the row's tokens, then the drafts before it)."""
        kwargs: dict[str, Any] = {}
        if self._rope_deltas is not None:  # M-RoPE: each row's offset past its image
            kwargs["rope_deltas"] = self._rope_deltas
        model: Any = self._language_model
        output = model(inputs, cache=self.prompt_cache, **kwargs)
        logits = output.logits if hasattr(output, "logits") else output
        if self.logits_processors and any(self.logits_processors):
            self._ensure_token_context()
            tokens = cast(list[list[int]], inputs.tolist())
            rows = []
            for i, processors in enumerate(self.logits_processors):
                self.token_context[i].append(tokens[i][0])
                if not processors:
                    rows.append(logits[i])
                    continue
                width = len(drafts[i]) + 1  # past a row's drafts is padding: left as is
                done = [self._process(processors, logits[i, j:j + 1],
                                      [*self.token_context[i], *tokens[i][1:j + 1]])
                        for j in range(width)]
                rows.append(mx.concatenate([*done, logits[i, width:]], axis=0))
            logits = mx.stack(rows)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @staticmethod
    def _process(processors: list[Any], logits: mx.array, context: list[int]) -> mx.array:
        for p in processors:
            if hasattr(p, "process_last_token"):  # such a row never drafts: one position
                logits = p.process_last_token(context[-1], logits)
            else:
                logits = p(mx.array(context), logits)
        return logits

    def _verify(self, pending: list[int],
                drafts: list[list[int]]) -> list[GenerationBatch.Response]:
        spec = self.speculation
        width = max(len(d) for d in drafts)
        rows = [[pending[i], *d, *([pending[i]] * (width - len(d)))]
                for i, d in enumerate(drafts)]
        dtype = self._next_tokens.dtype
        inputs = mx.array(rows, dtype=dtype)
        logprobs = self._forward(inputs, drafts)
        batch, positions, vocab = logprobs.shape
        picks = cast(list[list[int]], self.sampler(
            logprobs.reshape(batch * positions, vocab)).reshape(batch, positions).tolist())
        emitted: list[list[int]] = []
        next_tokens, rejected = [], []
        for i, draft in enumerate(drafts):
            a = 0
            while a < len(draft) and picks[i][a] == draft[a]:
                a += 1
            emitted.append([pending[i], *draft[:a]])
            next_tokens.append(picks[i][a])
            rejected.append(width - a)
            uid = self.uids[i]
            spec.fed(uid, emitted[-1])
            if self.token_context and a:
                self.token_context[i].extend(draft[:a])
            if draft:
                spec.account(uid, len(draft), a)
                processors: list[Any] = (self.logits_processors[i]
                                         if self.logits_processors else None) or []
                for p in processors:
                    p.rollback(len(draft) - a)  # what it saw at the rejected positions
        rewind(self.prompt_cache, rejected)
        # the tokens this step fed (engines/vision/turns.py reads them when a row leaves);
        # mypy types these by the None mlx-vlm starts them with
        self._current_tokens = mx.array(pending, dtype=dtype)  # type: ignore[assignment]
        self._current_lps = None
        self._next_tokens = mx.array(next_tokens, dtype=dtype)
        self._next_lps = None
        spec.verify_steps += 1
        return self._respond(emitted)

    def _respond(self, emitted: list[list[int]]) -> list[GenerationBatch.Response]:
        """One response per token, in order; a row stops at its first stop or length."""
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            finish = None
            for tok in emitted[i]:
                self._num_tokens[i] += 1
                if self.stop_criteria(tok):
                    finish = "stop"
                elif self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                responses.append(self.Response(uid=uid, token=tok, token_logprob=0.0,
                                               finish_reason=finish))
                if finish is not None:
                    break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    # -- the step mlx-vlm's BatchGenerator calls --------------------------------
    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids:
            return []
        plan = self._plan()
        if plan is not None:
            return self._verify(*plan)
        responses: list[GenerationBatch.Response] = super().next()
        for r in responses:  # a plain step feeds each row the token it returns
            self.speculation.fed(int(r.uid), (int(r.token),))
        return responses


def rewind(caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` positions from mlx-vlm ``BatchKVCache`` layers:
    trim what every row rejected, shift the rows that rejected more right by the rest."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    for c in caches:
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()
