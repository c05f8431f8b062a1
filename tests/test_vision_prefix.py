"""Prefix reuse for vision prompts (issue 11): turn 2 of a conversation about the same
image resumes from turn 1's KV state (mlx-vlm's prefix cache salted with mlxd's namespace:
model, media hashes, cache salt), reports it as ``cached_tokens``, and answers exactly as a
cold run with the prefix cache off; turn 2 resumes after turn 1's answer too (its KV is
stored when it finishes); a different image with the same text reuses nothing."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxd.models.spec import ModelEntry
from tests.helpers.retrieval import registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("mlx_vlm")

FAMILY = "qwen2_vl"  # M-RoPE: resuming must keep its position state right


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def tiny_qwen(session_dir: Path) -> Path:
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"
    return build_tiny_vlm(FAMILY, root / FAMILY, root / "tokenizers")


@pytest.fixture(scope="module")
def servers(tiny_qwen: Path, session_dir: Path,
            test_home: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    entries = [ModelEntry(name=FAMILY, source=str(tiny_qwen))]
    warm = registry_config(session_dir / "vlm-prefix-on.yaml", entries, test_home,
                           max_num_seqs=2)
    cold = registry_config(session_dir / "vlm-prefix-off.yaml", entries, test_home,
                           max_num_seqs=2, prefix_cache_bytes=0)
    with running_server(warm) as on, running_server(cold) as off:
        yield on, off


def turn_one(url: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You describe images carefully, in a few words."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What colour is this?"}]}]


def tower_runs(srv: RunningServer) -> int:
    """How many prompts' images went through the vision tower, as /v1/models shows."""
    with srv.client() as http:
        card = http.get(f"/v1/models/{FAMILY}").json()
    return int(card["vision_tower_runs"])


def chat(srv: RunningServer, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one greedy request."""
    answer, prompt, cached, _ = chat_logprobs(srv, messages)
    return answer, prompt, cached


def chat_logprobs(srv: RunningServer,
                  messages: list[dict[str, Any]]) -> tuple[str, int, int, list[float]]:
    """One greedy request: its answer, prompt and cached tokens, and its first token's
    top log-probabilities (positions set wrong on resume would move them)."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    r = client.chat.completions.create(model=FAMILY, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=5)
    usage = r.usage
    assert usage is not None and r.choices[0].logprobs is not None
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    content = r.choices[0].logprobs.content or []
    top = [t.logprob for t in content[0].top_logprobs] if content else []
    return str(r.choices[0].message.content), usage.prompt_tokens, cached, top


def test_turn_two_on_the_same_image_resumes_turn_ones_kv_state(
        servers: tuple[RunningServer, RunningServer]) -> None:
    on, off = servers
    url = png((220, 30, 30))
    first = turn_one(url)
    answer, prompt1, cached1 = chat(on, first)
    assert cached1 == 0  # nothing stored yet
    runs = tower_runs(on)
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And what shape is it, in one word?"}]
    warm_answer, prompt2, cached2, warm_top = chat_logprobs(on, second)
    assert tower_runs(on) == runs  # turn 2 takes the image's features from the cache
    assert prompt2 > prompt1
    assert cached2 >= prompt1 // 2, (cached2, prompt1)  # most of turn 1's prompt, image included
    cold_answer, _, cold_cached, cold_top = chat_logprobs(off, second)
    assert cold_cached == 0
    assert warm_answer == cold_answer  # resuming (M-RoPE positions included) changes nothing
    assert warm_top == pytest.approx(cold_top, abs=1e-4)


def test_a_different_image_with_the_same_text_reuses_nothing(
        servers: tuple[RunningServer, RunningServer]) -> None:
    on, off = servers
    chat(on, turn_one(png((30, 200, 40))))
    runs = tower_runs(on)
    other = turn_one(png((30, 50, 220)))  # same size, same text: only the pixels differ
    answer, _, cached = chat(on, other)
    assert cached == 0
    assert tower_runs(on) == runs + 1  # a new image is encoded
    assert answer == chat(off, other)[0]


def test_turn_two_resumes_after_turn_ones_answer(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """The answer's KV state is stored when it finishes, so turn 2 prefills only what
    follows the answer; greedy tokens and top-5 log-probabilities stay a cold run's. The
    two turn-1 requests run batched, with prompts of different lengths (one row of the
    batch cache is left-padded), so each row's own state must be the one stored."""
    from concurrent.futures import ThreadPoolExecutor

    on, off = servers
    firsts = [turn_one(png((200, 200, 40))), turn_one(png((90, 20, 160)))]
    firsts[1][0]["content"] += " Be brief, and name only the main colour."
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: chat_answer(on, m, max_tokens=24), firsts))
    for first, (answer, prompt1, completion1) in zip(firsts, answers, strict=True):
        second = [*first, {"role": "assistant", "content": answer},
                  {"role": "user", "content": "And what shape is it, in one word?"}]
        warm_answer, _, cached2, warm_top = chat_logprobs(on, second)
        assert cached2 > prompt1, (cached2, prompt1, completion1)  # past turn 1's prompt
        cold_answer, _, _, cold_top = chat_logprobs(off, second)
        assert warm_answer == cold_answer
        assert warm_top == pytest.approx(cold_top, abs=1e-4)


def chat_answer(srv: RunningServer, messages: list[dict[str, Any]],
                max_tokens: int) -> tuple[str, int, int]:
    """(answer, prompt tokens, completion tokens) of one greedy request."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    r = client.chat.completions.create(model=FAMILY, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=max_tokens, temperature=0)
    assert r.usage is not None
    return str(r.choices[0].message.content), r.usage.prompt_tokens, r.usage.completion_tokens


def test_resident_bytes_equal_mlx_vlms_own_count_as_blocks_come_and_go(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """The prefix cache's byte count (kept per block, re-measured only when a block's
    storage changes) equals mlx-vlm's sum over every block's arrays: after the stores of
    the tests above, after a new turn stores more, and after evictions down to a small
    bound (with some blocks released and reused)."""
    on, _ = servers
    chat(on, turn_one(png((60, 60, 200))))  # loaded, with something stored
    apc = on.ctx.manager.get(FAMILY).engine.scheduler.decoder._apc

    def upstream() -> int:
        return sum(b.resident_bytes() for b in apc.pool)

    stored = apc.resident_bytes()
    assert stored > 0 and stored == upstream()
    chat(on, turn_one(png((10, 120, 90))))
    assert apc.resident_bytes() == upstream() > stored
    bound = apc.memory_max_bytes
    try:
        apc.memory_max_bytes = stored // 3
        apc._make_room()  # evicts idle blocks down to the bound
        assert apc.resident_bytes() == upstream() <= stored // 3
        chat(on, turn_one(png((240, 240, 240))))  # freed blocks take new KV
        assert apc.resident_bytes() == upstream()
    finally:
        apc.memory_max_bytes = bound


def test_a_vision_request_starts_no_process(servers: tuple[RunningServer, RunningServer],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-vlm's prefix cache reads the free memory before each prefill and store: with
    psutil (in the vision extra) it reads it in-process; without, it ran ``vm_stat`` as a
    subprocess, forking the whole server (over 1 GB here) several times per request."""
    import subprocess

    started: list[Any] = []
    real = subprocess.Popen.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        started.append(args[0] if args else kwargs.get("args"))
        real(self, *args, **kwargs)

    on, _ = servers
    monkeypatch.setattr(subprocess.Popen, "__init__", spy)
    first = turn_one(png((130, 60, 10)))
    answer, _, _ = chat(on, first)
    chat(on, [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And what shape is it?"}])
    assert started == []


def test_a_request_ending_with_its_first_token_runs_no_decode_step(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """The first token comes back from the prefill that sampled it: a request that ends
    there (``max_tokens: 1``, or a stop id) leaves before any decode step runs, where
    mlx-vlm's pipelined batch would first compute a second token and throw it away."""
    import openai

    on, _ = servers
    client = openai.OpenAI(base_url=on.url + "/v1", api_key="x")
    messages = turn_one(png((90, 200, 40)))
    longer = client.chat.completions.create(model=FAMILY, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=6, temperature=0)
    gen = on.ctx.manager.get(FAMILY).engine.scheduler.decoder._gen
    steps = gen._steps_counter
    one = client.chat.completions.create(model=FAMILY, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=1, temperature=0)
    assert gen._steps_counter == steps
    assert one.choices[0].finish_reason == "length"
    assert one.usage is not None and one.usage.completion_tokens == 1
    first = str(one.choices[0].message.content)
    assert str(longer.choices[0].message.content).startswith(first)

    with on.client() as http:
        ids = http.post("/tokenize", json={"model": FAMILY, "prompt": first,
                                           "add_special_tokens": False}).json()["tokens"]
    stopped = client.chat.completions.create(
        model=FAMILY, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"stop_token_ids": ids[:1]})
    assert gen._steps_counter == steps
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    # and a request that goes on returns every token once, as before
    again = client.chat.completions.create(model=FAMILY, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=6, temperature=0)
    assert again.choices[0].message.content == longer.choices[0].message.content
    assert again.usage is not None and longer.usage is not None
    assert again.usage.completion_tokens == longer.usage.completion_tokens


def _prefix_metrics(srv: RunningServer) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with srv.client() as http:
        text = http.get("/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("mlxd_prefix_cache") and s.labels.get("model") == FAMILY}


def _card_bytes(srv: RunningServer) -> int:
    with srv.client() as http:
        return int(http.get(f"/v1/models/{FAMILY}").json()["prefix_cache_bytes"])


def test_model_card_and_metrics_show_the_vision_prefix_cache(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """The cache that gives turn 2 its ``cached_tokens`` is counted where a text model's
    is: ``prefix_cache_bytes`` on /v1/models/NAME and the mlxd_prefix_cache_* series."""
    on, off = servers
    before = _prefix_metrics(on)
    first = turn_one(png((200, 200, 30)))
    answer, _, _ = chat(on, first)
    _, _, cached = chat(on, [*first, {"role": "assistant", "content": answer},
                             {"role": "user", "content": "Is it bright?"}])
    assert cached > 0
    after = _prefix_metrics(on)
    assert after["mlxd_prefix_cache_bytes"] > 0 and _card_bytes(on) > 0
    assert after["mlxd_prefix_cache_lookups_total"] == before.get(
        "mlxd_prefix_cache_lookups_total", 0) + 2
    assert after["mlxd_prefix_cache_hits_total"] >= before.get(
        "mlxd_prefix_cache_hits_total", 0) + 1
    chat(off, first)  # the cache off (--prefix-cache-bytes 0): nothing to show
    assert _card_bytes(off) == 0
    assert _prefix_metrics(off).get("mlxd_prefix_cache_lookups_total", 0) == 0
