"""Admission by live KV (engines/text/kv_admission.py): under a small memory budget a request
that can never fit is refused with the numbers, long requests sent together all
complete while the newest are preempted and resumed, the engine's own live-KV count
never exceeds its allowance, and a preempted sequence answers exactly as it would have
uninterrupted."""

from __future__ import annotations

import concurrent.futures
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.models.memory import weights_bytes_of_folder
from tests.conftest import tiny_config
from tests.helpers.server import RunningServer, running_server

# the tiny Llama: 2 layers x 4 KV heads x 16 dims x K and V x float32
BYTES_PER_TOKEN = 2 * 2 * 4 * 16 * 4
PREFIX_CACHE_BYTES = 1 << 20
CONTEXT = 768  # --max-context: every request here runs to the end of it


def transient_of(model: Path, max_num_seqs: int = 16) -> int:
    """The transient reserve the engine counts for ``model`` (CPU: prefill chunks of 256)."""
    from mlxd.engines.kernels.prefill import cpu_prefill_chunk
    from mlxd.models.memory import read_config, text_transient_bytes

    return text_transient_bytes(read_config(model), cpu_prefill_chunk(2048),
                                prefill_rows=max_num_seqs, decode_rows=max_num_seqs)


def kv_server(model: Path, home: Path, kv_tokens: int, transient: bool = True,
              max_num_seqs: int = 16, **kw: object) -> Iterator[RunningServer]:
    """A server whose budget leaves the model about ``kv_tokens`` tokens of KV (beside its
    transient reserve, or without room for it when ``transient`` is False)."""
    reserve = transient_of(model, max_num_seqs) if transient else 0
    budget = (weights_bytes_of_folder(model) + PREFIX_CACHE_BYTES + reserve
              + kv_tokens * BYTES_PER_TOKEN)
    cfg = tiny_config(model, home, served_model_name="tiny", memory_budget=str(budget),
                      prefix_cache_bytes=PREFIX_CACHE_BYTES, kv_reserve_tokens=64,
                      enable_prefix_cache_persist=False, max_num_seqs=max_num_seqs, **kw)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    yield from kv_server(tiny_model, test_home, kv_tokens=300)


@pytest.fixture(scope="module")
def busy_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    # room for every request alone (768 tokens), not for four growing at once
    yield from kv_server(tiny_model, test_home, kv_tokens=1000, max_context=CONTEXT,
                         max_num_seqs=4, kv_output_estimate=64)


def kv_metrics(srv: RunningServer) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("mlxd_kv_", "mlxd_prefix_cache_hits")) and \
                    sample.labels.get("model") == "tiny":
                out[sample.name.removesuffix("_total")] = sample.value
    return out


def prompt_of(i: int, words: int = 40) -> str:
    """About a hundred tokens (with 40 words), different for each ``i``."""
    return f"Story {i}: " + " ".join(f"word{(i * 7 + k) % 50}" for k in range(words))


def complete(srv: RunningServer, prompt: str, max_tokens: int | None = None) -> tuple[str, str]:
    return complete_usage(srv, prompt, max_tokens)[:2]


def complete_usage(srv: RunningServer, prompt: str,
                   max_tokens: int | None = None) -> tuple[str, str, int]:
    """Text, finish reason and prompt tokens of a greedy completion."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=300, max_retries=0)
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                  max_tokens=max_tokens)
    assert r.usage is not None
    return r.choices[0].text, str(r.choices[0].finish_reason), r.usage.prompt_tokens


def test_never_fitting_request_is_refused_with_the_numbers(small_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt_of(0), max_tokens=400)
    message = e.value.message
    found = re.search(r"KV memory for (\d+) tokens .* x (\d+) bytes per token = (\d+) bytes, "
                      r"more than this model's KV allowance of (\d+) bytes", message)
    assert found, message
    tokens, per_token, need, allowance = map(int, found.groups())
    assert per_token == BYTES_PER_TOKEN and need == tokens * per_token > allowance
    assert 250 * BYTES_PER_TOKEN < allowance < 350 * BYTES_PER_TOKEN
    # a request that fits alone still runs
    text, reason = complete(small_server, prompt_of(0), max_tokens=20)
    assert reason == "length" and text


@pytest.fixture(scope="module")
def no_transient_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    # weights + prefix cache + 300 tokens of KV: no room for the transient reserve
    yield from kv_server(tiny_model, test_home, kv_tokens=300, transient=False)


def test_a_budget_without_room_for_the_transient_reserve_refuses_with_the_numbers(
        no_transient_server: RunningServer, tiny_model: Path) -> None:
    """A request whose KV fits beside the weights and prefix cache is refused when what a
    step holds beyond the KV (prefill activations, logits) does not fit too; the message,
    ``/v1/models`` and ``/metrics`` name the same reserve."""
    srv = no_transient_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt_of(0), max_tokens=20)
    message = e.value.message
    found = re.search(r"KV memory for (\d+) tokens .* = (\d+) bytes, more than this model's "
                      r"KV allowance of (\d+) bytes \(memory budget (\d+) less its weights "
                      r"(\d+), prefix cache (\d+) and transient reserve (\d+)\)", message)
    assert found, message
    tokens, need, allowance, budget, weights, prefix, transient = map(int, found.groups())
    assert tokens < 300 and prefix == PREFIX_CACHE_BYTES
    assert need <= budget - weights - prefix  # it would fit if the transient were not counted
    assert allowance == max(0, budget - weights - prefix - transient) < need
    assert transient == transient_of(tiny_model) > 300 * BYTES_PER_TOKEN
    card = httpx.get(srv.url + "/v1/models/tiny", timeout=30).json()
    assert card["transient_reserve_bytes"] == transient
    assert kv_metrics(srv)["mlxd_kv_transient_reserve_bytes"] == transient


def test_long_requests_together_all_complete_within_the_allowance(
        busy_server: RunningServer) -> None:
    before = kv_metrics(busy_server)
    prompts = [prompt_of(i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(busy_server, p), prompts))
    assert all(reason == "length" and text for text, reason in results), results
    after = kv_metrics(busy_server)
    assert after["mlxd_kv_preemptions"] > before.get("mlxd_kv_preemptions", 0)
    assert 0 < after["mlxd_kv_peak_live_bytes"] <= after["mlxd_kv_allowance_bytes"]
    assert after["mlxd_kv_live_bytes"] == 0 and after["mlxd_kv_waiting_for_memory"] == 0


def test_preempted_sequence_answers_as_if_uninterrupted(
        busy_server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    target = prompt_of(42, words=25)  # a prompt length none of the others has
    alone, alone_reason, n_prompt = complete_usage(busy_server, target)
    before = kv_metrics(busy_server)
    caplog.set_level(logging.INFO, logger="mlxd.engines.text.scheduler")
    # three older requests grow until the newest, the target, must make room
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        fillers = [pool.submit(complete, busy_server, prompt_of(i)) for i in range(3)]
        for _ in range(200):  # until all three run
            if kv_metrics(busy_server).get("mlxd_kv_granted_bytes", 0) >= 3 * 100 * \
                    BYTES_PER_TOKEN:
                break
            concurrent.futures.wait(fillers, timeout=0.02)
        shared = pool.submit(complete, busy_server, target)
        assert all(f.result()[1] == "length" for f in fillers)
        text, reason = shared.result()
    after = kv_metrics(busy_server)
    assert after["mlxd_kv_preemptions"] > before["mlxd_kv_preemptions"]
    assert f"(prompt {n_prompt} tokens) preempted for KV memory" in caplog.text
    # a resumed sequence picks up its KV from the prefix cache
    assert after["mlxd_prefix_cache_hits"] > before["mlxd_prefix_cache_hits"]
    assert (text, reason) == (alone, alone_reason)


def test_a_second_model_shrinks_the_first_models_allowance(
        tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> None:
    """Across models: what another model holds comes off this model's KV allowance, so a
    second model's load and long prompts on the first never add up past the budget."""
    from mlxd.models.spec import ModelEntry
    from tests.helpers.retrieval import registry_config

    budget = (weights_bytes_of_folder(tiny_model) + weights_bytes_of_folder(tiny_model_b)
              + 2 * PREFIX_CACHE_BYTES + transient_of(tiny_model) + transient_of(tiny_model_b)
              + 2000 * BYTES_PER_TOKEN)
    entries = [ModelEntry(name="tiny", source=str(tiny_model)),
               ModelEntry(name="tiny-b", source=str(tiny_model_b))]
    cfg = registry_config(tmp_path / "models.yaml", entries, tmp_path / "home",
                          no_starter=True, memory_budget=str(budget),
                          prefix_cache_bytes=PREFIX_CACHE_BYTES, kv_reserve_tokens=64,
                          enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        complete(srv, prompt_of(1), max_tokens=4)
        alone = kv_metrics(srv)["mlxd_kv_allowance_bytes"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model="tiny-b", prompt=prompt_of(2), max_tokens=4)
        complete(srv, prompt_of(3), max_tokens=4)
        beside = kv_metrics(srv)["mlxd_kv_allowance_bytes"]
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    held_by_b = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "mlxd_model_memory_bytes" and s.labels["model"] == "tiny-b")
    assert held_by_b > 0
    assert alone - beside == held_by_b
