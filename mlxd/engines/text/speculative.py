"""Speculative decoding inside the batched scheduler: prompt-lookup drafts verified in-batch.

``SpeculativeBatch`` replaces mlx-lm's ``GenerationBatch`` inside a
``BatchGenerator`` (``install``). On a step where some sequence's recent
tokens recur earlier in its prompt or output, that sequence drafts the
tokens that followed the earlier occurrence; every row of the batch then
runs ONE forward over ``[pending, d1..dK]`` (rows with shorter or no drafts
are padded), each position is processed and sampled exactly as a plain step
would (logits processors see the context plus the drafts before it), and a
row keeps its drafts while each equals the token sampled before it
("sample, then compare": exact at temperature 0, and for a fixed draft it
accepts with probability p(d), so sampling keeps its distribution). The
KV cache is rewound per row: the batch trims the smallest rejection, and
what rows rejected beyond it is masked where it lies (``gapped_cache``), not
copied out of the rows' history.

Steps where no sequence can draft use mlx-lm's pipelined step unchanged,
except a step where every row reaches ``max_tokens``: its pending tokens are
returned without the forward that would only compute the token after them.
The decoder installs this batch with speculation off too, for that step.
Each sequence's draft length adapts to what it accepted, and a sequence
whose drafts keep failing backs off exponentially, so text with nothing to
copy costs (almost) nothing. A verify forward costs every row of the batch
its width, so a step verifies only where the drafts' expected yield (each
row's acceptance rate times its draft length) pays for the wider forward
(``verify_width``): on a CPU a batch of 4 at 5k context took 250 ms for a
plain step and 435-530 ms to verify 8 tokens a row, so one row's uncertain
draft must not slow the other three. Models whose every layer is a plain
``BatchKVCache`` speculate, and so do hybrids whose recurrent layers are
gated delta-nets (Qwen3-Next, Qwen3.5): those are rewound by replaying the
layer over what each row kept (``recurrent_rewind``). Rotating caches and
other recurrent layers cannot be rewound exactly: those models do not
speculate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import ArraysCache

from mlxd.blas import fast_sgemm
from mlxd.engines.text.gapped_cache import drop_rows
from mlxd.engines.text.recurrent_rewind import RecurrentReplay
from mlxd.engines.upstream import mlx_lm as lm_internals

MODES = ("auto", "prompt-lookup", "draft", "off")
# Consecutive failed drafts back a sequence off for 2**fails - 1 steps, at most this many.
MAX_BACKOFF_STEPS = 32
# A sequence's first draft length; it doubles while drafts are accepted in full, up to
# ``num_draft_tokens``: a long copy verifies up to that many per forward, while text with
# little to copy never pays for a long rejected draft first.
FIRST_DRAFT_TOKENS = 4
# A sequence's acceptance rate (accepted / drafted, a moving average) before its first
# verdict: a match in its own context is more often right than wrong.
PRIOR_ACCEPTANCE = 0.75
# Each step a sequence's draft is judged not worth verifying, its rate moves this much of
# the way back to the prior (a sequence that failed earlier is retried now and then).
RATE_RECOVERY = 0.1
# What one more token per row costs a forward, as a fraction of a plain step, per row:
# a verify over ``m`` drafts a row at batch ``B`` costs ``1 + cost * B * m`` plain steps.
# On this project's 2-core CPU (SmolLM2-135M float32, 5k context): 0.056 at B=1, 0.034 at
# B=2, 0.025-0.04 at B=4. A GPU's decode is memory-bound: a few more tokens cost little.
CPU_VERIFY_COST = 0.04
GPU_VERIFY_COST = 0.005


def verify_width(drafts: Sequence[int], rates: Sequence[float], cost: float) -> int:
    """How many drafted tokens per row a verify step should check (0: a plain step).

    ``drafts[i]`` is row i's draft length (0: none), ``rates[i]`` its acceptance rate.
    A plain step yields one token a row; verifying ``m`` yields about ``sum(rate_i *
    min(draft_i, m))`` more and costs ``1 + cost * rows * m`` plain steps. Returns the
    ``m`` with the most tokens per unit of time, if that beats a plain step.
    """
    rows = len(drafts)
    best, best_rate = 0, float(rows)
    for m in range(1, max(drafts, default=0) + 1):
        gain = sum(r * min(d, m) for d, r in zip(drafts, rates))
        rate = (rows + gain) / (1 + cost * rows * m)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = m, rate
    return best


@dataclass(frozen=True)
class SpeculativeOptions:
    """How the batched scheduler speculates (from ``--speculative`` and friends)."""

    mode: str = "auto"  # auto: prompt lookup on a GPU or fast BLAS (see ``enabled``)
    num_draft_tokens: int = 8  # most tokens one sequence drafts per step
    max_verify_tokens: int = 32  # cap on batch x (1 + drafts) per forward
    ngram_min: int = 2
    ngram_max: int = 4
    stop_ids: frozenset[int] = frozenset()  # never drafted: a stop ends the sequence
    # a verify forward's cost per extra token and row (``verify_width``); None: by device
    verify_cost: float | None = None

    def cost(self) -> float:
        if self.verify_cost is not None:
            return self.verify_cost
        return GPU_VERIFY_COST if mx.default_device().type == mx.DeviceType.gpu \
            else CPU_VERIFY_COST

    @property
    def enabled(self) -> bool:
        if self.mode == "off" or self.num_draft_tokens <= 0:
            return False
        # auto: only where a forward over a few tokens costs about one token's: a GPU's
        # memory-bound decode, or a CPU whose float32 matmuls run on an optimised BLAS.
        # On a quiet 2-core box with OpenBLAS (``mlxd serve`` preloads it, mlxd/blas.py)
        # a copy answer ran 1.92x and chat 1.44x; with the mlx-cpu wheel's own reference
        # BLAS 0.83x and 0.96x (docs/benchmarks.md), so there it stays off.
        return self.mode != "auto" or mx.default_device().type == mx.DeviceType.gpu \
            or fast_sgemm()


class PromptLookup:
    """N-grams of one sequence's tokens -> where their latest continuation starts.

    Holds a reference to the batch's token list for the sequence (prompt plus
    output, as in the KV cache) and indexes what was appended since the last
    call, so a lookup is O(1) however long the context.

    Once a draft is taken from a source position, a match pointer follows that
    source while the output keeps equal to it, and the next drafts continue
    from there. A long copy then drafts the span it is copying, not the latest
    occurrence of its last few tokens: in code the same short n-grams recur
    (``=None, ``, ``self.``), and their latest occurrence is usually elsewhere.
    """

    def __init__(self, tokens: list[int], n_min: int, n_max: int) -> None:
        self.tokens = tokens
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0
        # tokens[_ptr] is the source token the next one should equal; None: no copy going
        self._ptr: int | None = None

    def sync(self) -> None:
        """Index the tokens appended since the last call and move the match pointer over
        them (it is dropped at the first token that differs from its source)."""
        toks = self.tokens
        ptr = self._ptr
        for i in range(self._indexed, len(toks)):
            ptr = ptr + 1 if ptr is not None and toks[ptr] == toks[i] else None
        self._ptr = ptr
        for end in range(max(self._indexed, 1), len(toks)):
            # the n-gram ending at ``end - 1`` is followed by the token at ``end``
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._index[tuple(toks[end - n:end])] = end
        self._indexed = max(self._indexed, len(toks))

    @property
    def copying(self) -> bool:
        """Whether the committed tokens so far continue the source of the last draft."""
        return self._ptr is not None

    def has_match(self) -> bool:
        """Whether a copy is going or the committed context's own suffix occurred before
        (a cheap hint, no device sync)."""
        toks = self.tokens
        return self._ptr is not None or any(
            tuple(toks[-n:]) in self._index
            for n in range(self.n_min, min(self.n_max, len(toks)) + 1))

    def draft(self, pending: int, k: int) -> list[int]:
        """Up to ``k`` tokens: the continuation of the copy going on if ``pending`` still
        follows its source, else what followed the latest earlier occurrence of the
        context's suffix (committed tokens + ``pending``), longest n-gram first."""
        ptr = self._ptr
        if ptr is not None and self.tokens[ptr] == pending:
            return self._read(ptr + 1, pending, k)
        start = self._lookup(pending)
        self._ptr = None if start is None else start - 1
        return [] if start is None else self._read(start, pending, k)

    def _lookup(self, pending: int) -> int | None:
        toks = self.tokens
        for n in range(min(self.n_max, len(toks) + 1), self.n_min - 1, -1):
            pos = self._index.get((*toks[len(toks) - n + 1:], pending))
            if pos is not None:
                return pos
        return None

    def _read(self, start: int, pending: int, k: int) -> list[int]:
        toks = self.tokens
        draft = toks[start:start + k]
        if len(draft) < k:  # the source runs into the present: a repeating
            ext = [*toks, pending, *draft]  # pattern, continued with its drafts
            while len(draft) < k:
                draft.append(ext[start + len(draft)])
                ext.append(draft[-1])
        return draft


@dataclass
class RowState:
    """One sequence's drafting state."""

    lookup: PromptLookup
    k: int
    skip: int = 0
    fails: int = 0
    rate: float = PRIOR_ACCEPTANCE  # accepted / drafted, a moving average

    def ready(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        self.lookup.sync()
        return self.lookup.has_match()

    def update(self, drafted: int, accepted: int, k_max: int) -> None:
        """Adapt the draft length: double after a full acceptance (a copy going on accepts
        long runs), shrink to what was accepted plus one, and back off exponentially while
        drafts keep failing."""
        self.rate = 0.5 * self.rate + 0.5 * accepted / max(1, drafted)
        if accepted == drafted:
            self.k = min(k_max, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self.fails += 1
            self.skip = min(MAX_BACKOFF_STEPS, (1 << self.fails) - 1)
        else:
            self.fails = 0


@dataclass
class SpecCounts:
    """Draft tokens one sequence had accepted and rejected (for usage and /metrics)."""

    accepted: int = 0
    rejected: int = 0


@dataclass
class _Plan:
    pending: list[int]
    drafts: list[list[int]] = field(default_factory=list)


class Drafter(Protocol):
    """A source of drafts other than prompt lookup (``engines/text/draft.py``: a draft model).

    The batch asks it for this step's drafts, lets it judge the target's samples
    (it may rewrite ``picks`` so that the compare keeps what its acceptance rule
    accepts, and puts the token that follows there), then tells it what each row
    accepted before the batch rewinds its cache and drops finished rows.
    """

    def propose(self, batch: SpeculativeBatch, budget: int) -> tuple[list[int],
                                                                     list[list[int]]] | None:
        """(pending tokens, each row's drafts), or None for a plain step."""
        ...

    def judge(self, batch: SpeculativeBatch, drafts: list[list[int]], logprobs: mx.array,
              picks: list[list[int]]) -> None:
        """Apply the drafter's acceptance rule to ``picks`` (the target's samples)."""
        ...

    def commit(self, batch: SpeculativeBatch, accepted: list[int]) -> None:
        """Each row kept ``accepted[i]`` of its drafts (plus the pending token)."""
        ...


class SpeculativeBatch(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` plus in-batch verification of prompt-lookup drafts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = SpeculativeOptions()
        self._rows: dict[int, RowState] = {}
        self.counts: dict[int, SpecCounts] = {}
        self.totals = SpecCounts()
        self.verify_steps = 0
        self.drafter: Drafter | None = None  # None: prompt lookup
        # how this model's caches rewind (found at the first plan; None: they cannot)
        self._replay: RecurrentReplay | None = None
        self._replay_known = False

    # -- planning ------------------------------------------------------------
    def _row(self, i: int) -> RowState:
        uid = self.uids[i]
        state = self._rows.get(uid)
        if state is None or state.lookup.tokens is not self.tokens[i]:
            opts = self.options
            state = RowState(PromptLookup(self.tokens[i], opts.ngram_min, opts.ngram_max),
                             k=min(FIRST_DRAFT_TOKENS, opts.num_draft_tokens))
            self._rows[uid] = state
        return state

    def _prune(self) -> None:
        if len(self._rows) > len(self.uids):
            live = set(self.uids)
            self._rows = {u: s for u, s in self._rows.items() if u in live}

    def _plan(self) -> _Plan | None:
        """Drafts for this step, or None to take mlx-lm's plain pipelined step."""
        opts = self.options
        if opts.mode == "off":
            return None
        batch = len(self.uids)
        budget = opts.max_verify_tokens // batch - 1
        replay = self.replay()
        # a draft model's own cache rewinds like a KV cache: it needs a plain target too
        if budget < 1 or replay is None or (self.drafter is not None and replay.modules):
            return None
        self._prune()
        if self.drafter is not None:
            proposal = self.drafter.propose(self, budget)
            return None if proposal is None else _Plan(*proposal)
        candidates = [i for i in range(batch) if self._row(i).ready()]
        if not candidates:
            return None
        mx.eval(self._next_tokens)
        plan = _Plan(pending=[int(t) for t in cast(list[int], self._next_tokens.tolist())])
        plan.drafts = [[] for _ in range(batch)]
        for i in candidates:
            state = self._rows[self.uids[i]]
            k = min(state.k, budget, self.max_tokens[i] - self._num_tokens[i] - 1)
            if k <= 0:
                continue
            draft = state.lookup.draft(plan.pending[i], k)
            for j, tok in enumerate(draft):
                if tok in opts.stop_ids:
                    draft = draft[:j]
                    break
            plan.drafts[i] = draft
        if not any(plan.drafts):
            return None
        states = [self._rows[u] for u in self.uids]
        m = verify_width([len(d) for d in plan.drafts], [r.rate for r in states], opts.cost())
        if not m:  # not worth a wider forward: the rates drift back, so a copy that
            for state, draft in zip(states, plan.drafts):  # starts later is tried again
                if draft:
                    state.rate += RATE_RECOVERY * (PRIOR_ACCEPTANCE - state.rate)
            return None
        plan.drafts = [d[:m] for d in plan.drafts]
        return plan

    def replay(self) -> RecurrentReplay | None:
        """How this batch's caches rewind after a verify step (an empty replay: plain KV
        caches only), or None when some layer cannot be rewound."""
        if not self._replay_known and self.prompt_cache:
            self._replay = RecurrentReplay.find(self.model, self.prompt_cache)
            self._replay_known = True
        return self._replay

    # -- one verify step -----------------------------------------------------
    def _verify(self, plan: _Plan) -> tuple[list[list[int]], list[list[mx.array]]]:
        """Forward ``[pending, drafts..]`` for every row, sample every position, keep each
        row's drafts up to the first mismatch, rewind the rest; returns the tokens (and
        their logprobs) now in the cache for each row."""
        drafts, pending = plan.drafts, plan.pending
        width = max(len(d) for d in drafts)
        rows = [[pending[i], *d, *([pending[i]] * (width - len(d)))] for i, d in enumerate(drafts)]
        inputs = mx.array(rows, dtype=self._next_tokens.dtype)
        replay = self.replay()
        assert replay is not None  # _plan checked
        saved = replay.save(self.prompt_cache)
        with replay.recording():
            logits = self.model(inputs, cache=self.prompt_cache)
        processors = self.logits_processors or []
        if any(processors):
            logits = self._process(logits, inputs, drafts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sample(logprobs)
        mx.eval(sampled, logprobs)
        picks = cast(list[list[int]], sampled.tolist())
        if self.drafter is not None:
            self.drafter.judge(self, drafts, logprobs, picks)
        out_tokens: list[list[int]] = []
        out_logprobs: list[list[mx.array]] = []
        next_tokens, next_logprobs, rejected = [], [], []
        for i, draft in enumerate(drafts):
            a = 0
            while a < len(draft) and picks[i][a] == draft[a]:
                a += 1
            out_tokens.append([pending[i], *draft[:a]])
            out_logprobs.append([self._next_logprobs[i], *(logprobs[i, j] for j in range(a))])
            next_tokens.append(picks[i][a])
            next_logprobs.append(logprobs[i, a])
            rejected.append(width - a)
            self.tokens[i].extend(out_tokens[-1])
            if processors and processors[i] and a:
                self._token_context[i].update_and_fetch(mx.array(draft[:a], dtype=mx.int32))
            if draft:
                self._account(i, len(draft), a)
        if self.drafter is not None:
            self.drafter.commit(self, [width - r for r in rejected])
        if replay.modules and any(rejected):
            replay.rewind(self.prompt_cache, saved, [width + 1 - r for r in rejected], width + 1)
        self._rewind(rejected)
        self._next_tokens = mx.array(next_tokens, dtype=self._next_tokens.dtype)
        self._next_logprobs = next_logprobs
        self.verify_steps += 1
        return out_tokens, out_logprobs

    def _account(self, i: int, drafted: int, accepted: int) -> None:
        self._rows[self.uids[i]].update(drafted, accepted, self.options.num_draft_tokens)
        counts = self.counts.setdefault(self.uids[i], SpecCounts())
        counts.accepted += accepted
        counts.rejected += drafted - accepted
        self.totals.accepted += accepted
        self.totals.rejected += drafted - accepted

    def _process(self, logits: mx.array, inputs: mx.array, drafts: list[list[int]]) -> mx.array:
        """Run each row's processors at every position it drafted, with the context a plain
        step would have had there (prompt, output, pending token, drafts before it)."""
        out = []
        for e, processors in enumerate(self.logits_processors or []):
            if not processors:
                out.append(logits[e])
                continue
            context = self._token_context[e].update_and_fetch(inputs[e, :1])
            positions = []
            for j in range(logits.shape[1]):
                row = logits[e, j:j + 1]
                if j <= len(drafts[e]):  # past a row's drafts is padding: left as is
                    ctx = context if j == 0 else mx.concatenate([context, inputs[e, 1:j + 1]
                                                                 .astype(context.dtype)])
                    for processor in processors:
                        row = processor(ctx, row)
                positions.append(row)
            out.append(mx.concatenate(positions, axis=0))
        return mx.stack(out)

    def _sample(self, logprobs: mx.array) -> mx.array:
        batch, width, vocab = logprobs.shape
        given: list[Any] = list(self.samplers) if self.samplers else [None] * batch
        samplers = [self.fallback_sampler if s is None else s for s in given]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs.reshape(batch * width, vocab)).reshape(batch, width)
        return mx.stack([s(logprobs[e]) for e, s in enumerate(samplers)])

    def _rewind(self, rejected: list[int]) -> None:
        """Drop each row's rejected positions (``rewind_rows``)."""
        rewind_rows(self.prompt_cache, rejected)

    # -- the step mlx-lm's BatchGenerator calls --------------------------------
    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids:
            return []
        plan = self._plan()
        if plan is not None:
            return self._respond(*self._verify(plan))
        if all(n + 1 >= m for n, m in zip(self._num_tokens, self.max_tokens)):
            return self._last_step()
        return super().next()

    def _last_step(self) -> list[GenerationBatch.Response]:
        """Every row's pending token is its last (``max_tokens``): return them without
        the forward a plain step would run to feed them and sample the token after,
        which nobody reads (mlx-lm's step is pipelined: that forward would hold the
        model thread, and the prefix-cache insert that waits on it, past the answer's
        end). The caches, and the tokens they cover, stop before the pending token."""
        mx.eval(self._next_tokens, self._next_logprobs)
        pending = cast(list[int], self._next_tokens.tolist())
        return self._respond([[t] for t in pending], [[lp] for lp in self._next_logprobs])

    def _respond(self, tokens: list[list[int]],
                 logprobs: list[list[mx.array]]) -> list[GenerationBatch.Response]:
        """One response per token, in order; a finishing row's last one carries its cache."""
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            finish = None
            for tok, lp in zip(tokens[i], logprobs[i]):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(tok):
                    finish = "stop"
                done = finish is not None
                responses.append(self.Response(
                    uid=uid, token=tok, logprobs=lp, finish_reason=finish,
                    prompt_cache=self.extract_cache(i) if done else None,
                    all_tokens=self.tokens[i] if done else None))
                if done:
                    break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def rewind_rows(caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` positions of batched KV caches: trim what all
    rows rejected, and mask what some rejected beyond that (``GappedBatchKVCache``: no
    copy of the rows' history). Recurrent states are left to ``RecurrentReplay``."""
    common = min(rejected)
    if common:
        for cache in caches:
            if not isinstance(cache, ArraysCache):
                cache.trim(common)
    extra = [r - common for r in rejected]
    if any(extra):
        drop_rows(caches, extra)


def install(gen: BatchGenerator, options: SpeculativeOptions,
            drafter: Drafter | None = None) -> SpeculativeBatch:
    """Make ``gen`` decode through a ``SpeculativeBatch`` (it must not have started);
    ``drafter`` replaces prompt lookup (a draft model)."""
    old = lm_internals.generation_batch(gen)
    if len(old):
        raise RuntimeError("install speculation before the first sequence joins")
    spec = SpeculativeBatch.empty(gen.model, gen.sampler)
    spec.options = options
    spec.drafter = drafter
    lm_internals.replace_generation_batch(gen, spec)
    return spec


def pop_counts(batch: SpeculativeBatch | None, uids: Sequence[int]) -> dict[int, SpecCounts]:
    """Take the draft counts of sequences that have left (or are leaving) the batch."""
    if batch is None:
        return {}
    return {u: batch.counts.pop(u) for u in uids if u in batch.counts}
