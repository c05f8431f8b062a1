"""Quantized KV inside the batch (``--kv-bits``, engines/text/quantized_cache.py).

The batched quantized cache gives exactly the greedy tokens of mlx-lm's single-sequence
``QuantizedKVCache`` for rows joining at different steps; a row moved into the prefix
cache (stored quantized) and inserted again resumes exactly; speculative decoding and
grammar-constrained rows keep their tokens on it; a served model answers with it and
reports quantized bytes; bad values are clear errors. The model is a tiny random Llama
whose head dimension (64) takes the default group size.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache
from prometheus_client.parser import text_string_to_metric_families

from mlxd.cli import build_parser
from mlxd.cli.serve import config_from_args
from mlxd.engines.text.engine import MLXLanguageModel, TextEngineOptions
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.prefix_cache import PrefixCache
from mlxd.engines.text.quantized_cache import KVQuantization, QuantizedBatchKVCache
from mlxd.engines.text.sampling import greedy
from mlxd.engines.text.speculative import SpeculativeOptions
from mlxd.engines.text.structured import GrammarTokenizer
from mlxd.engines.upstream import mlx_lm as lm_internals
from mlxd.engines.vision.engine import MLXMultimodalLM
from mlxd.errors import ModelLoadError
from mlxd.models.memory import weights_bytes_of_folder
from mlxd.models.registry import RegistryError, parse_registry
from mlxd.runtime.worker import ModelWorker
from tests.conftest import tiny_config
from tests.helpers.decoding import run_jobs
from tests.helpers.server import RunningServer, running_server

# 2 layers x 2 KV heads x 64 dims x K and V: float32, and 8 bits + a float32 scale and
# bias per 64 values
VALUES_PER_TOKEN = 2 * 2 * 64 * 2
FP32_PER_TOKEN = VALUES_PER_TOKEN * 4
Q8_PER_TOKEN = VALUES_PER_TOKEN + VALUES_PER_TOKEN // 64 * 2 * 4


@pytest.fixture(scope="module")
def lm(tiny_model_hd64: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(tiny_model_hd64))


def lone(model: Any, tokens: list[int], n: int, bits: int) -> list[int]:
    """Greedy tokens of one sequence through mlx-lm's own ``QuantizedKVCache``."""
    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    steps = generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def decoder(model: Any, bits: int | None, **kw: Any) -> LMBatchDecoder:
    return LMBatchDecoder(model, eos_ids=[], max_num_seqs=4, prefill_step_size=64,
                          kv_quantization=KVQuantization(bits) if bits else None, **kw)


PROMPTS = [list(range(5, 17)), [20, 21, 22], list(range(30, 49)), [50, 51]]
JOINS = [0, 0, 3, 5]  # the step each row enters at


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_rows_equal_single_sequence_quantized_kv(lm: tuple[Any, Any],
                                                          bits: int) -> None:
    model, _ = lm
    expected = [lone(model, p, 10, bits) for p in PROMPTS]
    dec = decoder(model, bits)
    got = run_jobs(dec, [{"tokens": p, "max": 10, "join": j} for p, j in zip(PROMPTS, JOINS)],
                   [])
    assert got == expected
    if bits == 4:  # the comparison can tell: full precision decodes otherwise
        assert run_jobs(decoder(model, None), [{"tokens": p, "max": 10} for p in PROMPTS],
                        []) != expected


def test_the_serial_decoder_runs_on_quantized_kv_and_checkpoints_it(
        lm: tuple[Any, Any]) -> None:
    """``--no-batching`` (and unbatchable models): one sequence through ``generate_step``
    on quantized KV; its prompt checkpoint is a plain ``QuantizedKVCache`` per layer."""
    from mlxd.engines.text.mlx_lm_decoder import LMSerialDecoder

    model, _ = lm
    serial = LMSerialDecoder(model, prefill_step_size=64, kv_quantization=KVQuantization(4))
    steps = serial.start(SimpleNamespace(tokens=PROMPTS[2]), greedy, [], 10,  # type: ignore[arg-type]
                         checkpoint_prompt=True)
    assert [int(t) for t, _ in steps] == lone(model, PROMPTS[2], 10, 4)
    state = serial.prompt_state()
    assert state is not None and all(type(c) is QuantizedKVCache for c in state[0])


def test_a_hybrids_attention_layers_quantize_and_its_recurrent_state_stays(
        session_dir: Path) -> None:
    """Qwen3-Next (gated delta-net + attention, 64-dim heads here): the batch equals a lone
    run whose attention layers are mlx-lm's ``QuantizedKVCache`` beside its own
    ``ArraysCache`` states."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache
    from mlx_lm.utils import load_model

    from mlxd.engines.text.hybrid_cache import prefill_batch_size
    from tests.helpers.tiny_hybrids import _configs
    from tests.helpers.tiny_models import save_random_mlx_lm

    out = session_dir / "tiny-qwen3-next-hd64"
    out.mkdir(exist_ok=True)
    save_random_mlx_lm(out, {**_configs(512)["qwen3_next"], "head_dim": 64,
                             "eos_token_id": 1}, seed=0)
    model = load_model(out)[0]

    def lone_hybrid(tokens: list[int]) -> list[int]:
        cache = [c if isinstance(c, ArraysCache) else QuantizedKVCache(64, 8)
                 for c in make_prompt_cache(model)]
        steps = generate_step(mx.array(tokens), model, max_tokens=8, prompt_cache=cache,
                              sampler=lambda x: mx.argmax(x, axis=-1))
        return [int(t) for t, _ in steps]

    prompts = PROMPTS[:3]
    dec = decoder(model, 8, prefill_batch_size=prefill_batch_size(
        "qwen3_next", make_prompt_cache(model), 4))
    got = run_jobs(dec, [{"tokens": p, "max": 8, "join": j} for p, j in zip(prompts, JOINS)],
                   [])
    assert got == [lone_hybrid(p) for p in prompts]


def test_a_row_moved_to_the_prefix_cache_resumes_exactly(lm: tuple[Any, Any]) -> None:
    model, _ = lm
    prompt, total, first = list(range(60, 80)), 12, 5
    dec = decoder(model, 8)
    uid = dec.insert(SimpleNamespace(tokens=prompt), 0, None, greedy, [], set(), total)
    head: list[int] = []
    while len(head) < first:
        head += [r.token for r in dec.next()[1] if r.uid == uid]
    # mid-generation, as a preemption does: out of the batch into the prefix cache
    cache, covered = dec.remove([uid], return_caches=True)[uid]
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in cache)
    assert sum(c.nbytes for c in cache) == Q8_PER_TOKEN * len(covered)
    pc = PrefixCache(1 << 20, identity="tiny:kv8g64")
    ns = pc.namespace((), None)
    pc.insert(list(covered), cache, ns)
    assert pc.nbytes == Q8_PER_TOKEN * len(covered)

    resumed_prompt = prompt + head
    stored, n_cached = pc.fetch(resumed_prompt, ns)
    assert n_cached == len(resumed_prompt) - 1  # the last token is fed again
    uid2 = dec.insert(SimpleNamespace(tokens=resumed_prompt), n_cached, stored, greedy, [],
                      set(), total - first)
    tail: list[int] = []
    while len(tail) < total - first:
        tail += [r.token for r in dec.next()[1] if r.uid == uid2]
    assert head + tail == lone(model, prompt, total, 8)


def test_quantized_entries_go_to_the_disk_tier_and_come_back_exactly(tmp_path: Path) -> None:
    from mlxd.engines.text.prefix_disk import DiskTier

    def state(seed: int) -> list[Any]:
        layers = []
        for layer in range(2):
            mx.random.seed(seed * 10 + layer)
            c = QuantizedKVCache(group_size=64, bits=8)
            c.keys = mx.quantize(mx.random.normal((1, 2, 20, 64)), group_size=64, bits=8)
            c.values = mx.quantize(mx.random.normal((1, 2, 20, 64)), group_size=64, bits=8)
            c.offset = 20
            layers.append(c)
        return layers

    disk = DiskTier(tmp_path, 1 << 20, "tiny:kv8g64")
    pc = PrefixCache(Q8_PER_TOKEN * 30, identity="tiny:kv8g64", disk=disk)  # one entry
    ns = pc.namespace((), None)
    first, second = list(range(100, 120)), list(range(200, 220))
    kept = state(1)
    pc.insert(first, state(1), ns)
    pc.insert(second, state(2), ns)  # evicts the first to disk
    disk.close()  # its write is done
    cache, n = pc.fetch([*first, 7], ns)
    assert n == 20 and disk.reads == 1
    for got, want in zip(cache, kept):
        assert type(got) is QuantizedKVCache and (got.bits, got.group_size) == (8, 64)
        for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values)):
            assert mx.array_equal(a, b)


@pytest.mark.parametrize("drafting", ["prompt-lookup", "draft"])
def test_speculation_and_grammar_keep_their_tokens_on_quantized_kv(
        lm: tuple[Any, Any], tiny_model: Path, drafting: str) -> None:
    """Prompt lookup, or a draft model (the session's other tiny Llama: same tokenizer, its
    own full-precision cache), drafts; some drafts are rejected (masked in the quantized
    batch), a row joins mid-run and a grammar-constrained row shares the batch: every token
    equals decoding the same quantized batch without speculation."""
    from llguidance import LLMatcher
    from mlx_lm import load

    from mlxd.engines.text.draft import DraftModel
    from mlxd.engines.text.prompt_limits import vocab_bound

    model, tok = lm
    draft = load(str(tiny_model))[0] if drafting == "draft" else None
    vocab = vocab_bound(model, {}, len(tok))
    grammar = GrammarTokenizer(tok.backend_tokenizer, model.args.vocab_size,
                               sorted(tok.eos_token_ids))
    regex = LLMatcher.grammar_from_regex("(lo)+")
    loop = tok.encode("hello world, hello world, hello world, hello")

    def jobs() -> list[dict[str, Any]]:
        return [{"tokens": loop, "max": 24},
                {"tokens": tok.encode("lolo lolo lolo lolo lo"), "max": 16,
                 "procs": [grammar.processor(regex)]},
                {"tokens": loop[3:] + loop[:3], "max": 20, "join": 2}]

    def run(spec: bool) -> tuple[list[list[int]], tuple[int, int]]:
        dec = decoder(model, 8, speculative=SpeculativeOptions(
            mode=drafting if spec else "off", num_draft_tokens=4, verify_cost=0.0),
            drafter=(lambda: DraftModel(draft, vocab=vocab)) if draft is not None else None)
        out = run_jobs(dec, jobs(), [])
        return out, dec.draft_totals()

    plain, _ = run(False)
    fast, (accepted, rejected) = run(True)
    assert fast == plain
    assert set(tok.decode(plain[1]).replace("lo", "")) == set()
    assert accepted > 0 and rejected > 0


def test_the_batch_cache_is_quantized_and_counts_quantized_bytes(lm: tuple[Any, Any]) -> None:
    model, _ = lm
    dec = decoder(model, 8)
    dec.insert(SimpleNamespace(tokens=PROMPTS[0]), 0, None, greedy, [], set(), 4)
    dec.next()
    dec.next()
    batch = lm_internals.generation_batch(dec._gen).prompt_cache
    assert all(isinstance(c, QuantizedBatchKVCache) for c in batch)
    # one row, its buffer rounded up to 256 positions (mlx-lm's step)
    assert dec.cache_nbytes() == Q8_PER_TOKEN * 256


# -- served ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_server(tiny_model_hd64: Path, test_home: Path) -> Iterator[RunningServer]:
    cfg = tiny_config(tiny_model_hd64, test_home, served_model_name="q8", kv_bits=8,
                      memory_budget="2GB", prefix_cache_bytes=1 << 20, kv_reserve_tokens=64,
                      enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


def metrics(srv: RunningServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith("mlxd_kv_") and s.labels.get("model") == "q8":
                out[s.name] = s.value
    return out


def test_a_served_model_answers_on_8_bit_kv_and_reports_its_bytes(
        q8_server: RunningServer, tiny_model_hd64: Path) -> None:
    client = openai.OpenAI(base_url=q8_server.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    out = client.chat.completions.create(
        model="q8", messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
        temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    again = client.chat.completions.create(  # resumed from the quantized prefix cache
        model="q8", messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
        temperature=0)
    assert again.choices[0].message.content == out.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0

    card = httpx.get(q8_server.url + "/v1/models/q8").json()
    assert (card["kv_bits"], card["kv_group_size"]) == (8, 64)
    # the budget reserves 64 tokens of KV at 8 bits (and the prefix cache)
    assert card["estimated_bytes"] == (weights_bytes_of_folder(tiny_model_hd64) + (1 << 20)
                                       + 64 * Q8_PER_TOKEN)
    assert metrics(q8_server)["mlxd_kv_bytes_per_token"] == Q8_PER_TOKEN < FP32_PER_TOKEN


# -- bad values -----------------------------------------------------------------------


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


@pytest.mark.parametrize("flags", [["--kv-bits", "3"], ["--kv-bits", "16"],
                                   ["--kv-group-size", "0"], ["--kv-group-size", "7"],
                                   ["--kv-group-size", str(2**40)]])
def test_bad_kv_flags_are_refused_naming_the_choices(
        flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_parser().parse_args(flags)
    assert f"invalid choice: {flags[1]}" in capsys.readouterr().err
    good = config_from_args(serve_parser().parse_args(["--kv-bits", "4", "--kv-group-size",
                                                       "32"]))
    assert (good.kv_bits, good.kv_group_size) == (4, 32)


@pytest.mark.parametrize(("field", "value"), [("kv_bits", 3), ("kv_group_size", 0),
                                              ("kv_group_size", 7), ("kv_group_size", 10**9)])
def test_bad_registry_values_name_the_line_and_the_choices(field: str, value: int) -> None:
    text = f"models:\n  - name: m\n    source: /x\n    defaults:\n      {field}: {value}\n"
    with pytest.raises(RegistryError) as e:
        parse_registry(text, Path("models.yaml"))
    assert "models.yaml:5" in str(e.value) and f"{field} must be one of" in str(e.value)


def test_a_group_that_does_not_divide_the_head_dimension_is_a_load_error(
        tiny_model: Path) -> None:
    """The session's tiny model has 16-dim heads: 64-value groups cannot quantize them."""
    engine = MLXLanguageModel("t", tiny_model, ModelWorker("t"),
                              TextEngineOptions(kv_bits=8, kv_group_size=64))
    with pytest.raises(ModelLoadError) as e:
        engine.load()
    assert "--kv-bits 8 --kv-group-size 64" in str(e.value)
    engine.close()


def test_vision_models_refuse_quantized_kv_at_load(tmp_path: Path) -> None:
    engine = MLXMultimodalLM("v", tmp_path, ModelWorker("v"), TextEngineOptions(kv_bits=4))
    with pytest.raises(ModelLoadError, match="not supported for vision models"):
        engine.load()


def test_the_server_wide_flag_leaves_a_vision_model_at_full_precision(tmp_path: Path) -> None:
    """`--kv-bits` is for text models: a vision model served beside them loads as without
    it (a mixed registry keeps working); its own entry's kv_bits is still refused."""
    from mlxd.config import ServerConfig
    from mlxd.engines.factory import EngineFactory
    from mlxd.models.spec import ModelEntry, ModelKind

    factory = EngineFactory(ServerConfig(kv_bits=8, home=tmp_path), 1 << 30)
    text = factory.text_options(ModelEntry(name="t", source="x"), ModelKind.TEXT)
    vision = factory.text_options(ModelEntry(name="v", source="x"), ModelKind.VISION)
    own = factory.text_options(ModelEntry(name="v", source="x", defaults={"kv_bits": 4}),
                               ModelKind.VISION)
    assert (text.kv_bits, vision.kv_bits, own.kv_bits) == (8, None, 4)
