"""Speculative decoding with a draft model (``--draft-model``, ``engines/draft.py``).

Exactness is checked against the same decoder with speculation off, on real tiny
models: the target as its own draft, and a different random model with the same
tokenizer (``tiny_model_b``), which drafts wrong often.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engines.draft import DraftModel, DraftModelError, load_draft_model, rejection_rule
from mlxd.engines.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.prompt_limits import vocab_bound
from mlxd.engines.sampling import build_sampler, greedy
from mlxd.engines.speculative import SpeculativeOptions
from mlxd.generation.params import SamplingParams
from tests.test_speculative import _chi2_critical, _two_sample_chi2


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(tiny_model))


@pytest.fixture(scope="module")
def other_draft(tiny_model_b: Path, target: tuple[Any, Any]) -> Any:
    return load_draft_model(tiny_model_b, target[1])


@pytest.fixture(scope="module")
def near_draft(tiny_model: Path) -> Any:
    """The target with noise on every weight: a draft close to it, yet not equal."""
    from mlx.utils import tree_map
    from mlx_lm import load

    model = load(str(tiny_model))[0]
    mx.random.seed(5)
    model.update(tree_map(lambda w: w + 0.2 * mx.std(w) * mx.random.normal(w.shape),
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def decode(lm: tuple[Any, Any], jobs: list[dict[str, Any]], draft: Any = None, *, k: int = 4,
           max_num_seqs: int = 8) -> tuple[list[list[int]], tuple[int, int]]:
    """Run ``jobs`` through one ``LMBatchDecoder`` (a job with ``join`` enters at that
    step), drafting with ``draft`` (None: speculation off); tokens and (accepted, rejected)."""
    model, tok = lm
    eos = sorted(tok.eos_token_ids)
    vocab = vocab_bound(model, {}, len(tok))
    drafter = (lambda: DraftModel(draft, vocab=vocab)) if draft is not None else None
    decoder = LMBatchDecoder(model, eos_ids=eos, max_num_seqs=max_num_seqs,
                             prefill_step_size=512, drafter=drafter,
                             speculative=SpeculativeOptions(
                                 mode="draft" if draft is not None else "off",
                                 num_draft_tokens=k))
    out: list[list[int]] = [[] for _ in jobs]
    waiting = list(enumerate(jobs))
    owner: dict[int, int] = {}
    done, step = 0, 0
    while done < len(jobs):
        for j, job in [w for w in waiting if w[1].get("join", 0) <= step]:
            uid = decoder.insert(SimpleNamespace(tokens=job["tokens"]), 0, None,  # type: ignore[arg-type]
                                 job.get("sampler", greedy), job.get("procs", []), set(eos),
                                 job["max"])
            owner[uid] = j
            waiting.remove((j, job))
        _, responses = decoder.next()
        for r in responses:
            out[owner[r.uid]].append(r.token)
            done += r.finish_reason is not None
        step += 1
    totals = decoder.draft_totals()
    decoder.close()
    return out, totals


def mixed_jobs(tok: Any) -> list[dict[str, Any]]:
    """Rows of different lengths, two joining mid-run, one ending inside a draft's reach."""
    code = tok.encode(Path(__file__).read_text())
    return [
        {"tokens": code[:120], "max": 40},
        {"tokens": tok.encode("hello world, hello world, hello"), "max": 29},
        {"tokens": code[60:90], "max": 33, "join": 3},
        {"tokens": code[10:20], "max": 6},
        {"tokens": tok.encode("lolo lolo lo"), "max": 21, "join": 6},
    ]


def test_the_target_as_its_own_draft_accepts_everything(target: tuple[Any, Any]) -> None:
    model, tok = target
    jobs = mixed_jobs(tok)
    plain, _ = decode(target, jobs)
    fast, (accepted, rejected) = decode(target, jobs, draft=model)
    assert [len(t) for t in plain] == [j["max"] for j in jobs]
    assert fast == plain
    assert rejected == 0 and accepted > 60, (accepted, rejected)


def test_a_different_draft_gives_identical_greedy_tokens(target: tuple[Any, Any],
                                                         other_draft: Any) -> None:
    jobs = mixed_jobs(target[1])
    plain, _ = decode(target, jobs)
    fast, (accepted, rejected) = decode(target, jobs, draft=other_draft)
    assert fast == plain
    assert rejected > 0, (accepted, rejected)


def test_sampling_with_a_draft_keeps_the_distribution(target: tuple[Any, Any],
                                                      near_draft: Any) -> None:
    """The rejection rule min(1, p/q) with residual resampling: token frequencies per
    position match sampling without speculation (two-sample chi-square, p = 0.001)."""
    prompt = target[1].encode("lolo lolo lolo lo")
    n, length = 96, 5
    params = SamplingParams(temperature=1.0, top_k=4)

    def samples(draft: Any, seed: int) -> tuple[list[list[int]], tuple[int, int]]:
        mx.random.seed(seed)
        jobs = [{"tokens": prompt, "max": length, "sampler": build_sampler(params)}
                for _ in range(n)]
        return decode(target, jobs, draft=draft, max_num_seqs=8)

    plain, _ = samples(None, 3)
    fast, (accepted, rejected) = samples(near_draft, 4)
    assert accepted > 20 and rejected > 20, (accepted, rejected)
    for pos in range(1, length):
        stat, dof = _two_sample_chi2(Counter(s[pos] for s in plain), Counter(s[pos] for s in fast))
        assert stat < _chi2_critical(dof), (pos, stat, dof)


def test_the_rejection_rule_keeps_p_and_accepts_the_overlap() -> None:
    """Drafts d ~ q kept with probability min(1, p/q), else replaced from norm(max(0, p-q)):
    the tokens follow p, and the share kept is sum(min(p, q)) (here 0.5)."""
    n = 20_000
    p = mx.array([0.5, 0.3, 0.2, 0.0])
    q = mx.array([0.1, 0.6, 0.1, 0.2])
    mx.random.seed(11)
    drafts = mx.random.categorical(mx.log(mx.broadcast_to(q, (n, 4))))
    kept, alt = rejection_rule(mx.broadcast_to(p, (n, 4)), mx.broadcast_to(q, (n, 4)), drafts)
    tokens = mx.where(kept, drafts, alt)
    counts = Counter(tokens.tolist())
    expected = [n * x for x in p.tolist()]
    stat = sum((counts[t] - e) ** 2 / e for t, e in enumerate(expected) if e)
    assert counts[3] == 0 and stat < _chi2_critical(2), (counts, stat)
    assert abs(kept.astype(mx.float32).mean().item() - 0.5) < 0.02


def test_a_draft_with_another_vocabulary_is_refused(tiny_model: Path, tiny_model_b: Path,
                                                    tmp_path: Path,
                                                    target: tuple[Any, Any]) -> None:
    mismatch = shutil.copytree(tiny_model_b, tmp_path / "draft")
    spec = json.loads((mismatch / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (mismatch / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DraftModelError, match="vocabulary differs"):
        load_draft_model(mismatch, target[1])
