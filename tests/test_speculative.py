"""Speculative decoding (prompt lookup) inside the batched scheduler.

Exactness is checked against the same decoder with speculation off, on real
models: a tiny random Llama (greedy random models fall into loops that prompt
lookup drafts) and SmolLM2-135M copying text from its prompt.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.sampling import build_sampler
from mlxd.engines.text.speculative import PromptLookup, RowState, SpeculativeOptions
from mlxd.engines.text.structured import GrammarTokenizer
from mlxd.generation.params import SamplingParams
from tests.helpers.decoding import run_jobs


@pytest.fixture(scope="module")
def tiny_lm(tiny_model: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(tiny_model))


def decode(lm: tuple[Any, Any], jobs: list[dict[str, Any]], *, spec: bool, k: int = 4,
           max_num_seqs: int = 8) -> tuple[list[list[int]], tuple[int, int], list[list[float]]]:
    """Run ``jobs`` through one ``LMBatchDecoder``; a job with ``join`` enters at that step.
    Returns each job's tokens, the (accepted, rejected) totals and each token's top-2 margin."""
    model, tok = lm
    eos = sorted(tok.eos_token_ids)
    decoder = LMBatchDecoder(model, eos_ids=eos, max_num_seqs=max_num_seqs,
                             prefill_step_size=512,
                             # verify whenever a row drafts: these tests are about what
                             # verification computes, not when it pays (verify_width)
                             speculative=SpeculativeOptions(
                                 mode="prompt-lookup" if spec else "off", num_draft_tokens=k,
                                 verify_cost=0.0))
    margins: list[list[float]] = [[] for _ in jobs]

    def margin(j: int, r: Any) -> None:
        top2 = mx.topk(r.logprobs, 2).tolist()
        margins[j].append(abs(top2[1] - top2[0]))

    out = run_jobs(decoder, jobs, eos, margin)
    totals = decoder.draft_totals()
    decoder.close()
    return out, totals, margins


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2]
    lookup = PromptLookup(tokens, 2, 3)
    lookup.sync()
    assert lookup.draft(3, 3) == [7, 8, 2]  # (2, 3): its latest occurrence, not the first
    assert lookup.draft(3, 5) == [7, 8, 2, 3, 7]  # running into the present: it repeats
    assert lookup.draft(6, 4) == []  # (2, 6) never seen
    tokens.append(3)
    lookup.sync()
    assert lookup.draft(7, 2) == [8, 2]  # (2, 3, 7), indexed incrementally
    tokens[:] = [5, 5, 5]
    fresh = PromptLookup(tokens, 2, 3)
    fresh.sync()
    assert fresh.draft(5, 3) == [5, 5, 5]  # a run of one token drafts itself


def test_the_match_pointer_continues_the_copy_it_started() -> None:
    """Once a draft comes from a source, the next drafts continue that source while the
    output equals it, even where the latest occurrence of the suffix continues otherwise;
    the first token that differs ends the copy."""
    prompt = [1, 2, 3, 4, 5, 6, 9, 4, 5, 7]  # (4, 5) recurs: its latest occurrence -> 7
    tokens = [*prompt, 1]
    lookup = PromptLookup(tokens, 2, 2)
    lookup.sync()
    assert lookup.draft(2, 2) == [3, 4]  # (1, 2): the copy starts at the prompt's head
    tokens += [2, 3, 4]  # the pending token and both drafts were accepted
    lookup.sync()
    assert lookup.copying
    assert lookup.draft(5, 3) == [6, 9, 4]  # the copy goes on, not (4, 5) -> 7
    stateless = PromptLookup([*prompt, 1, 2, 3, 4], 2, 2)
    stateless.sync()
    assert stateless.draft(5, 1) == [7]  # what the latest occurrence alone would draft
    tokens += [5, 8]  # the model wrote 8 where the source has 6: the copy ended
    lookup.sync()
    assert not lookup.copying
    assert lookup.draft(9, 2) == []  # a dropped pointer would have read on: [4, 5]


def test_draft_length_doubles_while_drafts_are_accepted_in_full() -> None:
    """k doubles after each full acceptance up to the cap, falls to what was accepted plus
    one after a partial one, and a draft rejected outright backs the row off."""
    state = RowState(PromptLookup([], 2, 4), k=4)
    state.update(drafted=4, accepted=4, k_max=16)
    assert state.k == 8
    state.update(drafted=8, accepted=8, k_max=16)
    state.update(drafted=16, accepted=16, k_max=16)
    assert state.k == 16
    state.update(drafted=16, accepted=5, k_max=16)
    assert (state.k, state.skip) == (6, 0)
    state.update(drafted=6, accepted=0, k_max=16)
    assert (state.k, state.skip) == (1, 1)


def test_greedy_identical_in_mixed_batches(tiny_lm: tuple[Any, Any]) -> None:
    """Drafting and non-drafting rows share the batch, a row joins mid-run, and max_tokens
    falls inside what a row could draft: every token equals decoding without speculation."""
    _, tok = tiny_lm
    source = Path(math.__file__).read_text() if not math.__file__.endswith(".so") else ""
    code = tok.encode(source or Path(__file__).read_text())
    jobs = [
        {"tokens": code[:200], "max": 48},
        {"tokens": tok.encode("hello world, hello world, hello world, hello"), "max": 37},
        {"tokens": code[100:160], "max": 41, "join": 3},  # joins while others decode
        {"tokens": code[40:70] + code[40:70], "max": 7},  # ends inside a draft's reach
        {"tokens": tok.encode("lolo lolo lolo lolo lo"), "max": 23, "join": 5},
    ]
    plain, _, margins = decode(tiny_lm, jobs, spec=False)
    fast, (accepted, _), _ = decode(tiny_lm, jobs, spec=True)
    assert [len(t) for t in plain] == [j["max"] for j in jobs]
    assert fast == plain
    assert accepted > 40  # it really drafted (tokens beyond one per step)
    assert min(min(m) for m in margins) > 1e-4  # no near-ties that could flip either way


def test_long_drafts_keep_greedy_tokens(tiny_lm: tuple[Any, Any]) -> None:
    """With a cap of 16, drafts accepted in full double past 8 (verify widths up to 16),
    and the tokens still equal decoding without speculation."""
    _, tok = tiny_lm
    jobs = [{"tokens": tok.encode("hello world, hello world, hello world, hello"), "max": 64},
            {"tokens": tok.encode("lolo lolo lolo lolo lo"), "max": 40}]
    plain, _, margins = decode(tiny_lm, jobs, spec=False)
    fast, (accepted, _), _ = decode(tiny_lm, jobs, spec=True, k=16)
    short, (accepted_at_4, _), _ = decode(tiny_lm, jobs, spec=True, k=4)
    assert fast == short == plain
    assert min(min(m) for m in margins) > 1e-4
    assert accepted > accepted_at_4  # the longer drafts were used


def test_grammar_rejects_drafts_it_forbids(tiny_lm: tuple[Any, Any]) -> None:
    """The prompt makes prompt lookup draft ' lo', which the grammar forbids: those drafts
    are rejected and the constrained output equals decoding without speculation."""
    from llguidance import LLMatcher

    model, tok = tiny_lm
    grammar = GrammarTokenizer(tok.backend_tokenizer, model.args.vocab_size,
                               sorted(tok.eos_token_ids))
    regex = LLMatcher.grammar_from_regex("(lo)+")
    prompt = tok.encode("lolo lolo lolo lolo lolo lolo lo")

    def jobs() -> list[dict[str, Any]]:
        return [{"tokens": prompt, "max": 30, "procs": [grammar.processor(regex)]},
                {"tokens": prompt, "max": 30}]  # an unconstrained row in the same batch

    plain, _, _ = decode(tiny_lm, jobs(), spec=False)
    fast, (accepted, rejected), _ = decode(tiny_lm, jobs(), spec=True)
    assert fast == plain
    assert set(tok.decode(plain[0]).replace("lo", "")) == set()
    assert accepted > 0 and rejected > 0


def test_grammar_processor_rolls_back_to_a_shorter_context(tiny_lm: tuple[Any, Any]) -> None:
    """Fed a context with drafts, then the shorter accepted one, the mask equals that of a
    processor that only ever saw the accepted context."""
    from llguidance import LLMatcher

    model, tok = tiny_lm
    grammar = GrammarTokenizer(tok.backend_tokenizer, model.args.vocab_size,
                               sorted(tok.eos_token_ids))
    regex = LLMatcher.grammar_from_regex("(lo|la)+x")
    prompt = tok.encode("hi")
    lo, la = tok.encode("lo"), tok.encode("la")
    logits = mx.zeros((1, model.args.vocab_size))
    spec, plain = grammar.processor(regex), grammar.processor(regex)
    spec(mx.array(prompt), logits)
    plain(mx.array(prompt), logits)
    spec(mx.array(prompt + lo + la + lo), logits)  # drafts
    spec(mx.array(prompt + lo + la + tok.encode("7")), logits)  # a refused draft: no error
    got = spec(mx.array(prompt + lo + lo), logits)  # accepted: 'lo', then 'lo' sampled
    plain(mx.array(prompt + lo), logits)
    want = plain(mx.array(prompt + lo + lo), logits)
    assert mx.array_equal(got, want)


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _two_sample_chi2(a: Counter[Any], b: Counter[Any], min_count: int = 5) -> tuple[float, int]:
    """Chi-square statistic of two samples of equal size over pooled categories."""
    keys = sorted(set(a) | set(b), key=lambda x: -(a[x] + b[x]))
    cells, rest = [], [0, 0]
    for key in keys:
        if a[key] + b[key] >= 2 * min_count:
            cells.append((a[key], b[key]))
        else:
            rest[0] += a[key]
            rest[1] += b[key]
    if sum(rest):
        cells.append((rest[0], rest[1]))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y)
    return stat, max(1, len(cells) - 1)


def test_sampling_keeps_the_distribution(tiny_lm: tuple[Any, Any]) -> None:
    """Sample, then compare: with a fixed seed and top-k sampling, token frequencies at the
    positions where drafts were accepted match non-speculative sampling (two-sample
    chi-square per position, each below the p = 0.001 critical value)."""
    _, tok = tiny_lm
    prompt = tok.encode("lolo lolo lolo lolo lolo lolo lo")
    n, length = 96, 6
    sampler: Callable[[mx.array], mx.array] = build_sampler(
        SamplingParams(temperature=0.7, top_k=3))

    def samples(spec: bool, seed: int) -> tuple[list[list[int]], int]:
        mx.random.seed(seed)  # different seeds: the two samples must be independent
        jobs = [{"tokens": prompt, "max": length, "sampler": sampler} for _ in range(n)]
        out, (accepted, _), _ = decode(tiny_lm, jobs, spec=spec, max_num_seqs=8)
        return out, accepted

    plain, _ = samples(False, 7)
    fast, accepted = samples(True, 8)
    assert accepted > 30  # drafts were accepted at sampled positions
    for pos in range(1, length):
        stat, dof = _two_sample_chi2(Counter(s[pos] for s in plain), Counter(s[pos] for s in fast))
        assert stat < _chi2_critical(dof), (pos, stat, dof)
    pairs = _two_sample_chi2(Counter(tuple(s[1:3]) for s in plain),
                             Counter(tuple(s[1:3]) for s in fast))
    assert pairs[0] < _chi2_critical(pairs[1]), pairs


def test_smollm2_copies_with_identical_greedy_tokens(smollm2: Path) -> None:
    """Real weights, two answers that copy their prompts (code, a list) in one batch: the
    same greedy tokens with and without speculation, much of them accepted from drafts.
    A near-tie (top-2 logprob margin < 1e-3) could legitimately flip, so margins are
    checked first: these prompts have none (smallest margin ~0.12)."""
    from mlx_lm import load

    model, tok = load(str(smollm2))
    prompts = ["Repeat the following Python code exactly:\n\n```python\ndef add(a, b):\n"
               "    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n```",
               "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
               "honeydew, kiwi, lemon, mango."]
    jobs = [{"tokens": tok.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True), "max": 32}
            for p in prompts]
    plain, _, margins = decode((model, tok), jobs, spec=False)
    fast, (accepted, rejected), _ = decode((model, tok), jobs, spec=True)
    assert min(min(m) for m in margins) > 1e-3
    assert fast == plain, [tok.decode(t) for t in fast + plain]
    assert "def subtract(a, b)" in tok.decode(plain[0])
    assert accepted >= 15, (accepted, rejected)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "nemotron_h"])
def tiny_hybrid(request: pytest.FixtureRequest, session_dir: Path,
                tiny_model: Path) -> tuple[str, Any, Any]:
    from mlx_lm import load

    from tests.helpers.tiny_hybrids import build_hybrid

    out = session_dir / f"tiny-{request.param}"
    if not (out / "config.json").exists():
        build_hybrid(out, request.param, tiny_model)
    model, tok = load(str(out))
    return request.param, model, tok


def test_hybrid_greedy_identical_with_recurrent_layers_replayed(
        tiny_hybrid: tuple[str, Any, Any]) -> None:
    """Hybrids speculate: after a verify step the attention layers' KV caches are cut back
    per row and the gated delta-net states are replayed over what each row kept. Drafting
    and plain rows share the batch (so every verify step rejects padding somewhere), a row
    joins mid-run and max_tokens falls inside a draft's reach: every token equals decoding
    without speculation. A model whose recurrent layers cannot be replayed (Mamba-2 in
    Nemotron-H) does not speculate and says so."""
    arch, model, tok = tiny_hybrid
    lm = (model, tok)
    source = Path(__file__).read_text()
    code = tok.encode(source)
    jobs = [
        {"tokens": code[:150], "max": 40},
        {"tokens": tok.encode("hello world, hello world, hello world, hello"), "max": 37},
        {"tokens": code[300:360], "max": 33, "join": 3},
        {"tokens": code[40:70] + code[40:70], "max": 7},
        {"tokens": tok.encode("lolo lolo lolo lolo lo"), "max": 29, "join": 5},
    ]
    plain, _, margins = decode(lm, jobs, spec=False)
    fast, (accepted, rejected), _ = decode(lm, jobs, spec=True)
    assert [len(t) for t in plain] == [j["max"] for j in jobs]
    assert min(min(m) for m in margins) > 1e-4  # no near-ties that could flip either way
    assert fast == plain
    decoder = LMBatchDecoder(model, eos_ids=[], max_num_seqs=4, prefill_step_size=64,
                             speculative=SpeculativeOptions(mode="prompt-lookup"))
    speculation = decoder.speculation
    decoder.close()
    if arch == "nemotron_h":
        assert (accepted, rejected, speculation) == (0, 0, "off")
    else:
        # random weights fall into loops: many drafts are accepted, and some rejected
        assert accepted > 40 and rejected > 0, (accepted, rejected)
        assert speculation == "prompt-lookup"


class _CountingModel:
    """A model that counts its one-token forwards (decode steps), delegating the rest."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.decode_forwards = 0

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        if inputs.shape[1] == 1:
            self.decode_forwards += 1
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.mark.parametrize("spec", [False, True])
def test_a_step_where_every_row_ends_runs_no_forward(tiny_lm: tuple[Any, Any],
                                                     spec: bool) -> None:
    """mlx-lm's step is pipelined: it feeds the token it returns and samples the next. When
    every row of the batch returns its last token (max_tokens), that forward is skipped:
    N tokens cost N one-token forwards (the first samples from the prompt), not N + 1, and
    the finished row's cache covers exactly the tokens it reports."""
    from types import SimpleNamespace

    from mlxd.engines.text.sampling import greedy

    model, tok = tiny_lm
    counting = _CountingModel(model)
    # speculating, but with n-grams too long to ever match: every step is a plain one
    options = SpeculativeOptions(mode="prompt-lookup", ngram_min=64, ngram_max=64) if spec \
        else SpeculativeOptions(mode="off")
    decoder = LMBatchDecoder(counting, eos_ids=[], max_num_seqs=4, prefill_step_size=512,
                             speculative=options)
    prompt = tok.encode("a plain prompt with nothing to copy from")
    for max_tokens in (1, 5):
        counting.decode_forwards = 0
        uid = decoder.insert(SimpleNamespace(tokens=prompt), 0, None, greedy, [], set(),  # type: ignore[arg-type]
                             max_tokens)
        tokens, last = [], None
        while last is None:
            for r in decoder.next()[1]:
                assert r.uid == uid
                tokens.append(r.token)
                last = r if r.finish_reason is not None else None
        assert last.finish_reason == "length" and len(tokens) == max_tokens
        assert counting.decode_forwards == max_tokens
        assert last.all_tokens == prompt + tokens[:-1]
        assert last.prompt_cache[0].offset == len(last.all_tokens)
    decoder.close()


def test_a_verify_step_runs_only_where_the_drafts_pay_for_the_wider_forward() -> None:
    """``verify_width``: verifying m drafts a row costs ``1 + cost * rows * m`` plain steps
    and yields about ``rate * min(draft, m)`` more tokens a row."""
    from mlxd.engines.text.speculative import CPU_VERIFY_COST, verify_width

    cost = CPU_VERIFY_COST
    assert verify_width([8], [1.0], cost) == 8  # one stream copying: every draft
    assert verify_width([8], [0.02], cost) == 0  # drafts that keep failing: plain steps
    assert verify_width([0, 0], [1.0, 1.0], cost) == 0  # nothing drafted
    # four streams, one of them with a weak draft: the other three must not pay for it
    assert verify_width([8, 0, 0, 0], [0.3, 0.75, 0.75, 0.75], cost) == 0
    assert verify_width([8, 8, 8, 8], [0.9] * 4, cost) == 8  # four streams copying
    # a sure short draft and an unsure long one: verify as far as the sure one reaches
    assert verify_width([8, 2], [0.1, 1.0], cost) == 2
    assert verify_width([8, 8, 8, 8], [0.9] * 4, 0.0) == 8  # a free verify: everything
    assert verify_width([3, 8], [1.0, 1.0], 0.0) == 8
    # the worst values: no rows, zero-length drafts, rates at the bounds
    assert verify_width([], [], cost) == 0
    assert verify_width([0], [0.0], cost) == 0
    assert verify_width([1], [0.0], 0.0) == 0


def test_a_sequence_judged_not_worth_verifying_is_retried_later() -> None:
    """A low acceptance rate keeps a batch from verifying a sequence's drafts; each such
    step moves its rate back toward the prior, so a copy that starts later is tried."""
    from mlxd.engines.text.speculative import (
        CPU_VERIFY_COST,
        PRIOR_ACCEPTANCE,
        RATE_RECOVERY,
        verify_width,
    )

    state = RowState(PromptLookup([1, 2, 3], 2, 3), k=4)
    for _ in range(4):
        state.update(4, 0, 8)
    assert state.rate < 0.1
    declined = 0
    while verify_width([4, 0, 0, 0], [state.rate] + [PRIOR_ACCEPTANCE] * 3,
                       CPU_VERIFY_COST) == 0:
        state.rate += RATE_RECOVERY * (PRIOR_ACCEPTANCE - state.rate)
        declined += 1
        assert declined < 100
    assert declined > 3  # not at once: a failing sequence costs the batch little
