"""Draft-model speculation (``--draft-model``): a small model drafts for every row.

``DraftModel`` is the ``Drafter`` (``engines/text/speculative.py``) behind
``--speculative draft``. It keeps ONE batched KV cache for the draft model that
follows the target's batch row by row: rows that joined are prefilled with the
tokens the target holds for them, rows that left are filtered out (both found
by uid at each step), and after each verify every row is rewound to what the
target kept. Rows the target advanced without drafting (plain steps, back-off)
catch up in the next draft forward, right-padded like mlx-lm's prompt batches.
The verify forward, per-row KV rewind of the target, adaptive k and back-off
are the batch's own, shared with prompt lookup.

Acceptance. Greedy rows, and rows whose sampler is unknown or seeded, draft
the draft model's argmax and keep the batch's sample-then-compare: for a
one-hot draft that IS the rejection rule (keep d with probability p(d),
otherwise a token from p without d), and at temperature 0 it is exact.
Unseeded sampled rows draft d ~ q (the draft's distribution under the row's
temperature, top-p, min-p and top-k), keep it with probability
min(1, p(d) / q(d)) and, at the first rejection, take a token from
norm(max(0, p - q)): the standard rule, which leaves the target's
distribution unchanged and accepts more than a one-hot draft would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxd.engines.text.sampling import sampling_of
from mlxd.engines.text.speculative import SpeculativeBatch, rewind_rows
from mlxd.engines.upstream import mlx_lm as lm_internals
from mlxd.generation.params import SamplingParams

DRAFT_PREFILL_STEP = 512  # prompt tokens per draft forward when a row joins


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (tokenizer, cache layout)."""


def load_draft_model(path: Path, target_tokenizer: Any) -> Any:
    """The draft model at ``path``, checked against the target's tokenizer: the same
    vocabulary (token -> id) and plain KV caches, else ``DraftModelError``."""
    from mlx_lm.utils import load

    model, tokenizer = cast(tuple[Any, Any], load(str(path)))
    check_same_vocabulary(target_tokenizer, tokenizer)
    if not plain_kv(make_prompt_cache(model)):
        raise DraftModelError(
            f"draft model {path.name} has sliding-window or recurrent layers; a draft model "
            "needs plain KV caches (its cache is rewound after every verify)")
    return model


def plain_kv(cache: list[Any]) -> bool:
    """Whether every layer is a plain KV cache (batched as ``BatchKVCache``, rewindable)."""
    return all(type(c) is KVCache for c in cache)


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids than the target's."""
    want, got = target.get_vocab(), draft.get_vocab()
    if want == got:
        return
    differ = sorted(t for t in set(want) | set(got) if want.get(t) != got.get(t))
    raise DraftModelError(
        f"the draft model's vocabulary differs from the target's ({len(got)} vs {len(want)} "
        f"tokens, {len(differ)} differ, e.g. {differ[:3]!r}); a draft model must use the "
        "target's tokenizer")


def drafting_params(sampler: Any) -> SamplingParams | None:
    """The sampling a row's draft follows with the rejection rule, or None to draft the
    argmax (greedy, seeded or unknown samplers: sample-then-compare keeps them exact)."""
    params = sampling_of(sampler)
    if params is None or params.greedy or params.seed is not None:
        return None
    return params


def distribution(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities the row's sampler draws from (``engines/sampling.build_sampler``'s
    chain: top-p, min-p, top-k, then temperature), over the last axis."""
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.softmax(logprobs * (1.0 / params.temperature), axis=-1)


def rejection_rule(p: mx.array, q: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """At each position j (rows of ``p`` and ``q``, (n, vocab)) with a draft d_j ~ q_j:
    whether d_j is kept (with probability min(1, p(d_j) / q(d_j))) and the token that
    replaces it if not, drawn from norm(max(0, p_j - q_j)). Lazy arrays."""
    d = drafts[:, None]
    ratio = mx.take_along_axis(p, d, axis=-1)[:, 0] / mx.take_along_axis(q, d, axis=-1)[:, 0]
    residual = mx.maximum(p - q, 0.0)
    alt = mx.random.categorical(mx.log(residual))
    # a rejection implies p(d) < q(d), so d has no residual mass; rounding (p == q up to
    # float error) could still draw it: the residual's argmax then
    alt = mx.where(alt == drafts, mx.argmax(residual, axis=-1), alt)
    return mx.random.uniform(shape=ratio.shape) < ratio, alt


class DraftModel:
    """The ``Drafter`` of a draft model, with one batched cache in step with the batch."""

    def __init__(self, model: Any, *, vocab: int,
                 prefill_step_size: int = DRAFT_PREFILL_STEP) -> None:
        self.model = model
        self.vocab = vocab  # ids both models score: drafts never index past the target's
        self.prefill_step_size = prefill_step_size
        self.cache: list[Any] = []
        self.uids: list[int] = []
        self.lengths: list[int] = []  # row i's cache holds batch.tokens[i][:lengths[i]] ...
        self._base: list[int] = []  # ... plus, during a step, pending + drafts after len(tokens)
        self._depth = 0  # draft tokens sampled per row this step
        self._q: dict[int, mx.array] = {}  # sampled rows: q over their drafted positions
        self._params: list[SamplingParams | None] = []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    # -- the Drafter seam --------------------------------------------------------
    def propose(self, batch: SpeculativeBatch, budget: int) -> tuple[list[int],
                                                                     list[list[int]]] | None:
        """Draft up to each row's k tokens in ``depth`` batched draft forwards."""
        self._sync(batch)
        ks = [self._k(batch, i, budget) for i in range(len(batch.uids))]
        if max(ks) <= 0:
            return None
        mx.eval(lm_internals.pending_tokens(batch))
        pending = [int(t) for t in cast(list[int], lm_internals.pending_tokens(batch).tolist())]
        drafts = self._draft(batch, pending, max(ks))
        stops = batch.options.stop_ids
        for i, draft in enumerate(drafts):
            del draft[ks[i]:]
            for j, tok in enumerate(draft):
                if tok in stops:  # a stop ends the sequence: never drafted
                    del draft[j:]
                    break
        if not any(drafts):
            self.commit(batch, [0] * len(drafts))  # the plain step commits the pending tokens
            return None
        return pending, drafts

    def judge(self, batch: SpeculativeBatch, drafts: list[list[int]], logprobs: mx.array,
              picks: list[list[int]]) -> None:
        """The rejection rule for rows that drafted from q: rewrite their picks so the
        batch's compare keeps the accepted drafts and then emits the corrected token."""
        rows = [i for i in self._q if drafts[i]]
        if not rows:
            return
        tests = []
        for i in rows:
            n, params = len(drafts[i]), self._params[i]
            assert params is not None
            p = distribution(logprobs[i, :n].astype(mx.float32), params)
            q = self._q[i][:n]
            if q.shape[-1] < p.shape[-1]:  # a draft vocabulary narrower than the target's
                q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
            tests.append(rejection_rule(p, q, mx.array(drafts[i])))
        mx.eval(tests)
        for i, (keep, alt) in zip(rows, tests):
            kept, draft = cast(list[bool], keep.tolist()), drafts[i]
            a = kept.index(False) if False in kept else len(draft)
            picks[i][:a] = draft[:a]
            if a < len(draft):
                picks[i][a] = cast(list[int], alt.tolist())[a]

    def commit(self, batch: SpeculativeBatch, accepted: list[int]) -> None:
        """Keep each row's pending token and accepted drafts; rewind the rest."""
        keep = [b + 1 + min(a, self._depth - 1) for b, a in zip(self._base, accepted)]
        rewind_rows(self.cache, [n - k for n, k in zip(self.lengths, keep)])
        self.lengths = keep
        self._q = {}

    # -- drafting ------------------------------------------------------------------
    @staticmethod
    def _k(batch: SpeculativeBatch, i: int, budget: int) -> int:
        """Row ``i``'s draft length this step (0 while it backs off)."""
        state = batch._row(i)
        if state.skip > 0:
            state.skip -= 1
            return 0
        return max(0, min(state.k, budget, batch.max_tokens[i]
                              - lm_internals.generated_counts(batch)[i] - 1))

    def _draft(self, batch: SpeculativeBatch, pending: list[int], depth: int) -> list[list[int]]:
        """``depth`` tokens per row: one forward over what each row lacks plus its pending
        token (right-padded), then one forward per further token."""
        rows = len(pending)
        feeds = [[*batch.tokens[i][self.lengths[i]:], pending[i]] for i in range(rows)]
        self._base = [len(t) for t in batch.tokens]
        self._depth = depth
        samplers: list[Any] = list(batch.samplers) if batch.samplers else [None] * rows
        self._params = [drafting_params(s) for s in samplers]
        width = max(len(f) for f in feeds)
        for c in self.cache:
            c.prepare(right_padding=[width - len(f) for f in feeds])
        inputs = mx.array([f + [0] * (width - len(f)) for f in feeds])
        logits = self.model(inputs, cache=self.cache)
        for c in self.cache:
            c.finalize()
        last = logits[mx.arange(rows), mx.array([len(f) - 1 for f in feeds])]
        tokens, qs = [], []
        for step in range(depth):
            tok, q = self._pick(last[:, :self.vocab])
            tokens.append(tok)
            qs.append(q)
            if step + 1 < depth:
                last = self.model(tok[:, None], cache=self.cache)[:, -1]
        self.lengths = [b + depth for b in self._base]
        self._q = {i: mx.stack([q[i] for q in qs]) for i in qs[0]} if qs else {}
        drafted = mx.stack(tokens, axis=1)
        mx.eval(drafted, list(self._q.values()))
        return cast(list[list[int]], drafted.tolist())

    def _pick(self, logits: mx.array) -> tuple[mx.array, dict[int, mx.array]]:
        """Each row's next draft token: the argmax, or d ~ q for rows that sample; and q."""
        tokens = mx.argmax(logits, axis=-1)
        sampled = [i for i, p in enumerate(self._params) if p is not None]
        if not sampled:
            return tokens, {}
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        qs = {i: distribution(logprobs[i], cast(SamplingParams, self._params[i]))
              for i in sampled}
        picks = [mx.random.categorical(mx.log(qs[i])) if i in qs else tokens[i]
                 for i in range(logits.shape[0])]
        return mx.stack(picks).astype(tokens.dtype), qs

    # -- following the batch ---------------------------------------------------------
    def _sync(self, batch: SpeculativeBatch) -> None:
        """Drop rows that left, prefill rows that joined (the batch only filters and
        appends, so the rows that stay keep their order)."""
        live = set(batch.uids)
        keep = [j for j, u in enumerate(self.uids) if u in live]
        if len(keep) < len(self.uids):
            self._filter(keep)
        if self.uids != batch.uids[:len(self.uids)]:  # not seen before: start over
            self._filter([])
        joined = list(range(len(self.uids), len(batch.uids)))
        if joined:
            self._join(batch, joined)

    def _filter(self, keep: list[int]) -> None:
        self.uids = [self.uids[j] for j in keep]
        self.lengths = [self.lengths[j] for j in keep]
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)

    def _join(self, batch: SpeculativeBatch, rows: list[int]) -> None:
        """Prefill the draft with each joining row's tokens, then add them to the batch."""
        caches = []
        for i in rows:
            cache = make_prompt_cache(self.model)
            tokens = batch.tokens[i]
            for start in range(0, len(tokens), self.prefill_step_size):
                self.model(mx.array(tokens[start:start + self.prefill_step_size])[None],
                           cache=cache)
                mx.eval([c.state for c in cache])
            caches.append(cache)
            self.uids.append(batch.uids[i])
            self.lengths.append(len(tokens))
        merged = [BatchKVCache.merge([c[layer] for c in caches])
                  for layer in range(len(caches[0]))]
        if not self.cache:
            self.cache = merged
            return
        for own, new in zip(self.cache, merged):
            own.extend(new)
