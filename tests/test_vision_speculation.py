"""Prompt-lookup speculation inside the vision batch (issue 32, item 4).

Exactness is checked against the same decoder with speculation off, on a tiny random
qwen2_vl (M-RoPE: every row's text positions sit past its image by a per-row delta),
with rows that join the batch at different steps, with and without images. The
builder's small random weights make greedy decoding repeat one token, which drafts
perfectly: that shows the accepted path, and flatters acceptance (docs/vision.md). The
same model with its language weights drawn at unit scale answers with varied tokens,
so drafts are also rejected, by different amounts in the same step, and every row's
cache must be rewound by its own count. Models whose caches cannot be rewound
(gemma3's sliding windows) or whose text attention is bidirectional (PaliGemma) decode
without speculation, said once in the log. Over HTTP, a server with
``--speculative prompt-lookup`` answers image requests as one without it, and reports
the drafts it accepted in the usage.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.engines.text.speculative import SpeculativeOptions
from mlxd.models.spec import ModelEntry
from tests.helpers.decoding import run_jobs
from tests.helpers.retrieval import registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("mlx_vlm")

REPEAT = "What colour is this image? red red red red red red red red"


def tiny_vlm(session_dir: Path, family: str) -> Path:
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"  # shared with the other vision tests
    return build_tiny_vlm(family, root / family, root / "tokenizers")


@pytest.fixture(scope="module")
def qwen_folder(session_dir: Path) -> Path:
    return tiny_vlm(session_dir, "qwen2_vl")


def load_vlm(folder: Path, unit_scale: bool = False) -> tuple[Any, Any]:
    """A model and processor as the engine loads them (float32); ``unit_scale`` redraws
    the language model's matrices at unit variance per input (seeded)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load

    model, processor = load(str(folder))
    model.set_dtype(mx.float32)
    if unit_scale:
        mx.random.seed(0)
        lm = model.language_model
        lm.load_weights([(k, mx.random.normal(v.shape) / v.shape[-1] ** 0.5)
                         for k, v in tree_flatten(lm.parameters()) if v.ndim == 2], strict=False)
    return model, processor


def prepared(model: Any, processor: Any, text: str, rgb: tuple[int, int, int] | None,
             size: tuple[int, int] = (64, 64)) -> SimpleNamespace:
    """A prompt as the vision input processor prepares it: tokens and the image arrays."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    config = model.config
    chat = apply_chat_template(processor, config, text, num_images=1 if rgb else 0)
    images = [Image.new("RGB", size, rgb)] if rgb else None
    inputs = prepare_inputs(processor, images=images, prompts=chat,
                            image_token_index=config.image_token_id)
    arrays = {k: v for k, v in inputs.items()
              if k not in ("input_ids", "attention_mask") and v is not None}
    return SimpleNamespace(tokens=[int(t) for t in inputs["input_ids"][0].tolist()],
                           arrays=arrays, media=[], media_hashes=[],
                           request=SimpleNamespace(logprobs=False))


def decode(vlm: tuple[Any, Any], family: str, jobs: list[dict[str, Any]], *, spec: bool
           ) -> tuple[list[list[int]], tuple[int, int], str]:
    """Each job's tokens through one ``VLMBatchDecoder`` (a job with ``join`` enters at
    that step); the (accepted, rejected) draft totals and how the decoder drafted."""
    from mlxd.engines.vision.decoder import VLMBatchDecoder
    from mlxd.engines.vision.features import embed_prompt

    model, processor = vlm
    eos = [int(processor.tokenizer.eos_token_id)]
    decoder = VLMBatchDecoder(
        model, processor, lambda p: embed_prompt(model, family, p, None), eos_ids=eos,
        max_num_seqs=4, prefill_step_size=512, name=family,
        # verify whenever a row drafts: these tests are about what verification computes
        speculative=SpeculativeOptions(mode="prompt-lookup" if spec else "off",
                                       num_draft_tokens=4, verify_cost=0.0))
    out = run_jobs(decoder, jobs, eos)
    totals, mode = decoder.draft_totals(), decoder.speculation
    decoder.close()
    return out, totals, mode


def joining_jobs(vlm: tuple[Any, Any]) -> list[dict[str, Any]]:
    """Four rows, three with an image, each of another shape (so each row's M-RoPE delta
    differs); three join while others decode, one ends inside what it could draft."""
    model, processor = vlm
    specs = [(REPEAT, (200, 30, 30), (64, 64), 40, 0),
             ("def f(x): return x + x + x + x + x", None, (0, 0), 33, 2),
             ("Describe it. blue blue blue blue", (30, 30, 200), (112, 56), 29, 5),
             ("abc abc abc abc abc", (10, 200, 30), (56, 112), 7, 9)]
    jobs = []
    for text, rgb, size, max_tokens, join in specs:
        p = prepared(model, processor, text, rgb, size)
        jobs.append({"prompt": p, "tokens": p.tokens, "max": max_tokens, "join": join})
    return jobs


def test_greedy_identical_for_rows_joining_at_different_steps(qwen_folder: Path) -> None:
    """The builder's tiny model repeats a token: drafts are accepted, and every row's
    tokens equal decoding without speculation."""
    vlm = load_vlm(qwen_folder)
    jobs = joining_jobs(vlm)
    plain, _, _ = decode(vlm, "qwen2_vl", jobs, spec=False)
    fast, (accepted, _), mode = decode(vlm, "qwen2_vl", jobs, spec=True)
    assert mode == "prompt-lookup"
    assert [len(t) for t in plain] == [j["max"] for j in jobs]
    assert fast == plain
    assert accepted > 40  # it really drafted (tokens beyond one per step)


def test_rejected_drafts_rewind_each_row_by_its_own_count(qwen_folder: Path) -> None:
    """Varied answers: drafts are accepted and rejected, rows reject different counts in
    one step, and the tokens still equal decoding without speculation (a position or a
    KV slot left wrong after a rewind changes the next tokens)."""
    vlm = load_vlm(qwen_folder, unit_scale=True)
    jobs = joining_jobs(vlm)
    plain, _, _ = decode(vlm, "qwen2_vl", jobs, spec=False)
    fast, (accepted, rejected), _ = decode(vlm, "qwen2_vl", jobs, spec=True)
    assert len(set(plain[0])) > 10  # not one repeated token
    assert fast == plain
    assert accepted > 10 and rejected > 0


def test_rows_with_logprobs_and_processors_draft_and_match(qwen_folder: Path) -> None:
    """Rows that carry the decoder's row sampler draft too: a greedy row asking for
    logprobs gets the same tokens and log-probabilities (rejected positions forgotten), a
    row constrained by a grammar the same tokens (the matcher sees, at each draft, the
    drafts before it, and rolls back what was rejected), and a sampled row its full
    length (sample, then compare: its distribution is the text path's, tested there)."""
    from llguidance import LLMatcher

    from mlxd.engines.text.sampling import build_sampler
    from mlxd.engines.text.structured import GrammarTokenizer
    from mlxd.generation.params import SamplingParams

    vlm = load_vlm(qwen_folder, unit_scale=True)
    model, processor = vlm
    tok = processor.tokenizer
    grammar = GrammarTokenizer(tok.backend_tokenizer, model.language_model.args.vocab_size,
                               [int(tok.eos_token_id)])
    regex = LLMatcher.grammar_from_regex("(red |blue |green )+")

    def jobs() -> list[dict[str, Any]]:
        out = joining_jobs(vlm)
        out[0]["prompt"].request = SimpleNamespace(logprobs=True)
        out[1]["procs"] = [grammar.processor(regex)]
        out[3]["sampler"] = build_sampler(SamplingParams(temperature=0.3, top_k=2, seed=3))
        out[3]["max"] = 24
        return out

    def run(spec: bool) -> tuple[list[list[int]], list[float], list[tuple[int, int]]]:
        from mlxd.engines.vision.decoder import VLMBatchDecoder
        from mlxd.engines.vision.features import embed_prompt

        model, processor = vlm
        eos = [int(processor.tokenizer.eos_token_id)]
        decoder = VLMBatchDecoder(
            model, processor, lambda p: embed_prompt(model, "qwen2_vl", p, None),
            eos_ids=eos, max_num_seqs=4, prefill_step_size=512,
            speculative=SpeculativeOptions(mode="prompt-lookup" if spec else "off",
                                           num_draft_tokens=4, verify_cost=0.0))
        logprobs: list[float] = []
        uids: dict[int, int] = {}

        def record(j: int, r: Any) -> None:
            uids[j] = r.uid
            if j == 0:
                logprobs.append(float(r.logprobs[r.token].item()))

        out = run_jobs(decoder, jobs(), eos, record)
        counts = decoder.draft_counts(list(uids.values()))  # (accepted, rejected) per row
        decoder.close()
        return out, logprobs, [counts.get(uids[j], (0, 0)) for j in range(len(out))]

    plain, plain_lp, _ = run(False)
    fast, fast_lp, counts = run(True)
    assert fast[:3] == plain[:3]
    assert fast_lp == pytest.approx(plain_lp, abs=1e-4)
    assert len(fast_lp) == len(fast[0]) == 40
    assert len(fast[3]) == 24
    # the rows with logprobs, a grammar and a sampler drafted, and drafts were rejected
    assert all(counts[j][0] > 0 for j in (0, 1, 3)), counts
    assert sum(c[1] for c in counts) > 0, counts


@pytest.mark.parametrize(("family", "why"), [("gemma3", "RotatingKVCache"),
                                             ("paligemma", "bidirectional")])
def test_models_that_cannot_rewind_decode_without_speculation(
        session_dir: Path, family: str, why: str, caplog: pytest.LogCaptureFixture) -> None:
    from mlxd.engines.vision.decoder import VLMBatchDecoder
    from mlxd.engines.vision.features import embed_prompt

    model, processor = load_vlm(tiny_vlm(session_dir, family))
    with caplog.at_level(logging.WARNING, logger="mlxd.engines.vision.decoder"):
        decoder = VLMBatchDecoder(
            model, processor, lambda p: embed_prompt(model, family, p, None),
            eos_ids=[int(processor.tokenizer.eos_token_id)], max_num_seqs=2,
            prefill_step_size=512, name=family,
            speculative=SpeculativeOptions(mode="prompt-lookup"))
        decoder.reset()  # a new generator after a failed step: nothing logged again
    notes = [r.getMessage() for r in caplog.records if "speculation" in r.getMessage()]
    assert decoder.speculation == "off"
    assert len(notes) == 1 and why in notes[0] and family in notes[0]
    decoder.close()


# -- over HTTP: the same answers with and without speculation ---------------------------

def png(rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def servers(qwen_folder: Path, session_dir: Path,
            test_home: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    entries = [ModelEntry(name="vl", source=str(qwen_folder))]
    on = registry_config(session_dir / "vlm-spec-on.yaml", entries, test_home,
                         speculative="prompt-lookup", max_num_seqs=4)
    off = registry_config(session_dir / "vlm-spec-off.yaml", entries, test_home,
                          speculative="off", max_num_seqs=4)
    with running_server(on) as fast, running_server(off) as plain:
        yield fast, plain


def test_server_answers_as_without_speculation(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """An image request with repetitive text: the same answer and token count, drafts
    accepted in the usage and /metrics, and the model card says how it drafts."""
    import openai

    fast, plain = servers
    messages: Any = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png((200, 30, 30))}},
        {"type": "text", "text": REPEAT}]}]
    answers = []
    for srv in (fast, plain):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        answers.append(client.chat.completions.create(model="vl", messages=messages,
                                                      temperature=0, max_tokens=32))
    got, want = answers
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens == 32
    assert got.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert want.usage.completion_tokens_details.accepted_prediction_tokens == 0
    with fast.client() as http:
        assert http.get("/v1/models/vl").json()["speculative"] == "prompt-lookup"
        metrics = http.get("/metrics").text
    accepted = [line for line in metrics.splitlines()
                if line.startswith('mlxd_speculative_accepted_tokens_total{model="vl"}')]
    assert accepted and float(accepted[0].split()[-1]) > 0
    with plain.client() as http:
        assert http.get("/v1/models/vl").json()["speculative"] == "off"


def test_turn_two_resumes_after_an_answer_that_ended_on_a_verify_step(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """A row whose last tokens were accepted drafts stores its answer's KV state when it
    leaves (the verify step fed several tokens at once), so turn 2 resumes past turn 1's
    prompt, and answers as the server without speculation does."""
    import openai

    fast, plain = servers
    first: Any = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png((40, 160, 90))}},
        {"type": "text", "text": REPEAT}]}]
    client = openai.OpenAI(base_url=fast.url + "/v1", api_key="x", max_retries=0)
    one = client.chat.completions.create(model="vl", messages=first, temperature=0,
                                         max_tokens=24)
    assert one.usage is not None and one.usage.completion_tokens_details is not None
    assert one.usage.completion_tokens_details.accepted_prediction_tokens > 0
    second = [*first, {"role": "assistant", "content": one.choices[0].message.content},
              {"role": "user", "content": "And what shape is it, in one word?"}]
    answers = []
    for srv in (fast, plain):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        answers.append(c.chat.completions.create(model="vl", messages=second, temperature=0,
                                                 max_tokens=8))
    details = answers[0].usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    assert cached > one.usage.prompt_tokens, (cached, one.usage.prompt_tokens)
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
