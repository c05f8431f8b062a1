"""Speculative decoding with a draft model (``--draft-model``, ``engines/text/draft.py``).

Exactness is checked against the same decoder with speculation off, on real tiny
models: the target as its own draft, and a different random model with the same
tokenizer (``tiny_model_b``), which drafts wrong often.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.config import ServerConfig
from mlxd.engines.text.draft import DraftModel, DraftModelError, load_draft_model, rejection_rule
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.prompt_limits import vocab_bound
from mlxd.engines.text.sampling import build_sampler
from mlxd.engines.text.speculative import SpeculativeOptions
from mlxd.generation.params import SamplingParams
from mlxd.models.catalog import (
    CatalogError,
    build_catalog,
    model_entry_from_cli,
    registration_for,
)
from mlxd.models.memory import weights_bytes_of_folder
from tests.helpers.decoding import run_jobs
from tests.helpers.server import running_server
from tests.test_serve_flags import serve_parser
from tests.test_speculative import _chi2_critical, _two_sample_chi2


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(tiny_model))


@pytest.fixture(scope="module")
def other_draft(tiny_model_b: Path, target: tuple[Any, Any]) -> Any:
    return load_draft_model(tiny_model_b, target[1])


@pytest.fixture(scope="module")
def near_draft_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on every weight, saved: a draft close to it, yet not equal."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm import load

    model = load(str(tiny_model))[0]
    mx.random.seed(5)
    model.update(tree_map(lambda w: w + 0.2 * mx.std(w) * mx.random.normal(w.shape),
                          model.parameters()))
    out = Path(shutil.copytree(tiny_model, tmp_path_factory.mktemp("near") / "draft"))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return out


@pytest.fixture(scope="module")
def near_draft(near_draft_dir: Path, target: tuple[Any, Any]) -> Any:
    return load_draft_model(near_draft_dir, target[1])


class CheckedDraft(DraftModel):
    """A ``DraftModel`` that checks after every verify that each row's cache holds what a
    fresh prefill of the target's kept tokens gives (same length, same keys)."""

    checks = 0

    def commit(self, batch: Any, accepted: list[int]) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        super().commit(batch, accepted)
        for i, n in enumerate(self.lengths):
            got = self.cache[0].extract(i)
            fresh = make_prompt_cache(self.model)
            self.model(mx.array(batch.tokens[i][:n])[None], cache=fresh)
            assert got.offset == n, (got.offset, n)
            assert mx.allclose(got.keys[..., :n, :], fresh[0].keys[..., :n, :], atol=1e-4)
            CheckedDraft.checks += 1


def decode(lm: tuple[Any, Any], jobs: list[dict[str, Any]], draft: Any = None, *, k: int = 4,
           max_num_seqs: int = 8, checked: bool = False
           ) -> tuple[list[list[int]], tuple[int, int]]:
    """Run ``jobs`` through one ``LMBatchDecoder`` (a job with ``join`` enters at that
    step), drafting with ``draft`` (None: speculation off); tokens and (accepted, rejected)."""
    model, tok = lm
    eos = sorted(tok.eos_token_ids)
    vocab = vocab_bound(model, {}, len(tok))
    kind = CheckedDraft if checked else DraftModel
    drafter = (lambda: kind(draft, vocab=vocab)) if draft is not None else None
    decoder = LMBatchDecoder(model, eos_ids=eos, max_num_seqs=max_num_seqs,
                             prefill_step_size=512, drafter=drafter,
                             speculative=SpeculativeOptions(
                                 mode="draft" if draft is not None else "off",
                                 num_draft_tokens=k))
    out = run_jobs(decoder, jobs, eos)
    totals = decoder.draft_totals()
    decoder.close()
    return out, totals


def mixed_jobs(tok: Any) -> list[dict[str, Any]]:
    """Rows of different lengths, two joining mid-run, one ending inside a draft's reach."""
    code = tok.encode(Path(__file__).read_text()[:2000])
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
    """Rejections rewind the draft's cache row by row while rows join and finish: after
    every verify each row's draft cache equals a fresh prefill of the kept tokens."""
    jobs = mixed_jobs(target[1])
    plain, _ = decode(target, jobs)
    fast, (accepted, rejected) = decode(target, jobs, draft=other_draft, checked=True)
    assert fast == plain
    assert rejected > 0, (accepted, rejected)
    assert CheckedDraft.checks > 20


def test_grammar_rejects_drafts_it_forbids(target: tuple[Any, Any]) -> None:
    """The target as its own draft proposes its unconstrained tokens; under a grammar they
    are refused, rejected, and the constrained output equals decoding without drafts."""
    from llguidance import LLMatcher

    from mlxd.engines.text.structured import GrammarTokenizer

    model, tok = target
    grammar = GrammarTokenizer(tok.backend_tokenizer, model.args.vocab_size,
                               sorted(tok.eos_token_ids))
    prompt = tok.encode("hello world, hello world, hello")

    def jobs() -> list[dict[str, Any]]:
        # the free answer repeats itself ('lolo...'); this grammar makes it alternate
        regex = LLMatcher.grammar_from_regex("(la-le-)+")
        return [{"tokens": prompt, "max": 20, "procs": [grammar.processor(regex)]},
                {"tokens": prompt, "max": 20}]  # an unconstrained row in the same batch

    plain, _ = decode(target, jobs())
    fast, (accepted, rejected) = decode(target, jobs(), draft=model)
    assert fast == plain
    assert ("la-le-" * 20).startswith(tok.decode(plain[0]))
    assert rejected > 0 and accepted > 0, (accepted, rejected)


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


def test_serve_with_a_draft_model_over_http(tiny_model: Path, near_draft_dir: Path,
                                            test_home: Path, target: tuple[Any, Any]) -> None:
    """``mlxd serve MODEL --draft-model DRAFT``: the same greedy text as decoding without
    speculation; usage and /metrics report accepted and rejected drafts."""
    from openai import OpenAI

    from mlxd.cli.serve import config_from_args

    args = serve_parser().parse_args([str(tiny_model), "--draft-model", str(near_draft_dir),
                                      "--served-model-name", "tiny", "--no-starter",
                                      "--home", str(test_home), "--no-prefix-cache-persist"])
    config = config_from_args(args)
    assert config.draft_model == str(near_draft_dir) and config.speculative == "auto"
    prompts = [target[1].encode("hello world, hello world, hello"),
               target[1].encode(Path(__file__).read_text()[:1000])[:80]]
    plain, _ = decode(target, [{"tokens": p, "max": 24} for p in prompts])
    with running_server(config) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = [client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=24)
               for p in prompts]
        metrics = srv.client().get("/metrics").text
        card = srv.client().get("/v1/models/tiny").json()
    assert card["draft_model"] == str(near_draft_dir)
    assert [g.choices[0].text for g in got] == [target[1].decode(t) for t in plain]
    details = [g.usage.completion_tokens_details for g in got]
    assert sum(d.rejected_prediction_tokens for d in details) > 0
    assert sum(d.accepted_prediction_tokens for d in details) > 0
    assert 'mlxd_speculative_rejected_tokens_total{model="tiny"}' in metrics


def test_the_draft_model_counts_in_the_memory_estimate(tiny_model: Path, tiny_model_b: Path,
                                                       test_home: Path) -> None:
    alone = ServerConfig(model=str(tiny_model), home=test_home, no_starter=True)
    paired = alone.model_copy(update={"draft_model": str(tiny_model_b)})
    base = registration_for(model_entry_from_cli(alone), alone, 2**32)
    with_draft = registration_for(model_entry_from_cli(paired), paired, 2**32)
    assert with_draft.estimate - base.estimate > weights_bytes_of_folder(tiny_model_b)


def test_a_draft_model_that_names_nothing_is_refused(tiny_model: Path, test_home: Path) -> None:
    config = ServerConfig(model=str(tiny_model), home=test_home, no_starter=True,
                          draft_model="no/such\x00folder")
    with pytest.raises(CatalogError, match=r"draft_model .* does not exist"):
        build_catalog(config)


def test_a_draft_model_without_model_is_refused(tiny_model: Path, tiny_model_b: Path,
                                                test_home: Path) -> None:
    config = ServerConfig(draft_model=str(tiny_model_b), home=test_home)
    with pytest.raises(CatalogError, match="--draft-model drafts for MODEL"):
        build_catalog(config)
    config = ServerConfig(model=str(tiny_model), speculative="draft", home=test_home)
    with pytest.raises(CatalogError, match="--speculative draft needs --draft-model"):
        build_catalog(config)
