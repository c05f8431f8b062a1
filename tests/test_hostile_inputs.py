"""Hostile inputs must cost one 4xx, never the process or other users (issue 16: A0-A2, B4).

Token ids a client sends index MLX arrays, which MLX does not bounds-check on
CPU (an out-of-range ``logit_bias`` key used to segfault the server); a failed
sampler used to poison MLX's global PRNG for every later request; a bad seed
used to strand its request holding a lease; a 20 MB prompt used to be
tokenised in full (gigabytes) before its 400.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from tests.helpers.retrieval import assert_openai_error
from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "hi"}]
VOCAB = 2048  # tests/helpers/tiny_models.build_llama
WORST_IDS = [VOCAB, VOCAB + 1, 2**31, 2**31 - 1, 2**63, 2**63 - 1, 2**64, 10**30, -1, -VOCAB,
             -(2**63)]


def _chat(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2, **kw}


def _completion(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


# Every request field that carries token ids, in every API that has one (the
# Responses and Anthropic APIs take none), as (field the 400 names, request).
TOKEN_ID_FIELDS: list[tuple[str, Callable[[int], tuple[str, dict[str, Any]]]]] = [
    ("logit_bias", lambda t: _chat(logit_bias={str(t): 5})),
    ("logit_bias", lambda t: _chat(logit_bias={"5": 1, str(t): -5}, temperature=0.7)),
    ("stop_token_ids", lambda t: _chat(stop_token_ids=[2, t])),
    ("logit_bias", lambda t: _completion(logit_bias={str(t): 5})),
    ("stop_token_ids", lambda t: _completion(stop_token_ids=[t])),
    ("prompt", lambda t: _completion(prompt=[5, 6, t])),
    ("prompt", lambda t: _completion(prompt=[[5, 6], [7, t]])),
    ("prompt", lambda t: _completion(prompt=[t], echo=True, logprobs=2)),
]


def assert_still_serves(http: httpx.Client, **sampling: Any) -> None:
    """A normal sampled request still gets its tokens (the shared state is intact)."""
    path, body = _chat(temperature=0.7, max_tokens=4, **sampling)
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer) -> Iterator[httpx.Client]:
    with tiny_server.client() as c:
        yield c


# -- A0: token ids outside the vocabulary ---------------------------------------------------

@pytest.mark.parametrize(("field", "make"), TOKEN_ID_FIELDS)
def test_token_ids_outside_the_vocabulary_are_400s_naming_the_field(
        http: httpx.Client, field: str, make: Callable[[int], tuple[str, dict[str, Any]]]) -> None:
    for token in WORST_IDS:
        path, body = make(token)
        err = assert_openai_error(http.post(path, json=body), 400, "", param=field)
        assert str(token) in err["message"] or "token" in err["message"]
    path, body = make(VOCAB - 1)  # the largest valid id is accepted
    assert http.post(path, json=body).status_code == 200
    assert_still_serves(http)


def test_logit_bias_keys_that_are_not_integers_are_400s(http: httpx.Client) -> None:
    for key in ["²", "1.5", "abc", ""]:
        path, body = _chat(logit_bias={key: 1})
        assert_openai_error(http.post(path, json=body), 400, "logit_bias", param="logit_bias")
    assert_still_serves(http)


# -- A1: top_k at or above the vocabulary ---------------------------------------------------

@pytest.mark.parametrize("seed", [None, 3])
def test_top_k_at_or_above_the_vocabulary_means_off(http: httpx.Client,
                                                    seed: int | None) -> None:
    for top_k in [VOCAB, VOCAB + 1, 10**9]:
        path, body = _chat(temperature=0.7, top_k=top_k, seed=seed)
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert_still_serves(http)


def test_top_k_at_the_vocabulary_in_the_responses_and_anthropic_apis(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                         "temperature": 0.7, "top_k": VOCAB})
    assert r.status_code == 200, r.text
    r = http.post("/v1/messages", json={"model": "tiny", "messages": HI, "max_tokens": 2,
                                        "temperature": 0.7, "top_k": VOCAB})
    assert r.status_code == 200, r.text
    assert_still_serves(http)


# -- A1/A2: a failure inside one sequence fails that sequence alone -------------------------

def _broken_sampler(logprobs: mx.array) -> mx.array:
    """Fails the way top_k == vocabulary did: inside a compiled mlx-lm function whose
    captured state is MLX's global PRNG (which it leaves without a primitive)."""
    from mlx_lm.sample_utils import apply_top_k

    return apply_top_k(logprobs, logprobs.shape[-1])


BROKEN_SAMPLER, BROKEN_SETUP = 1001, 1002  # top_k values that select an injected fault


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults no HTTP request can cause any more, injected into the real scheduler."""
    from mlxd.engines.text import scheduler

    real = scheduler.build_sampler

    def build(params: Any) -> Any:
        if params.top_k == BROKEN_SAMPLER:
            return _broken_sampler
        if params.top_k == BROKEN_SETUP:
            raise OverflowError("injected: setup failed")
        return real(params)

    monkeypatch.setattr(scheduler, "build_sampler", build)


def _stream_tokens(url: str, out: list[Any], started: threading.Event) -> None:
    body = {"model": "tiny", "messages": HI, "max_tokens": 1500, "temperature": 0.7,
            "logit_bias": {"2": -100},  # no EOS: it runs while the other request fails
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            started.set()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))


@pytest.mark.parametrize("top_k", [BROKEN_SAMPLER, BROKEN_SETUP])
def test_a_failing_sequence_fails_alone_and_sampling_still_works(
        tiny_server: RunningServer, http: httpx.Client, faults: None, top_k: int) -> None:
    chunks: list[Any] = []
    started = threading.Event()
    neighbour = threading.Thread(target=_stream_tokens, args=(tiny_server.url, chunks, started))
    neighbour.start()
    assert started.wait(60)
    path, body = _chat(temperature=0.7, top_k=top_k, max_tokens=8)
    r = http.post(path, json=body)
    neighbour.join(120)
    assert r.status_code == 500, r.text
    assert "injected" in r.text or "top_k" in r.text, r.text
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["completion_tokens"] == 1500  # the neighbour lived through it
    assert_still_serves(http)
    assert_still_serves(http, seed=5)


@pytest.fixture(scope="module")
def serial_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(model=str(tiny_model), served_model_name="tiny", home=test_home,
                       no_starter=True, batching=False)
    with running_server(cfg) as srv:
        yield srv


@pytest.mark.parametrize("top_k", [BROKEN_SAMPLER, BROKEN_SETUP])
def test_a_failing_sequence_in_serial_mode_leaves_sampling_working(
        serial_server: RunningServer, faults: None, top_k: int) -> None:
    with serial_server.client(timeout=60) as http:
        path, body = _chat(temperature=0.7, top_k=top_k, max_tokens=8)
        r = http.post(path, json=body)
        assert r.status_code == 500, r.text
        assert_still_serves(http)
        assert_still_serves(http, seed=5)


def test_a_failed_step_leaves_the_scheduler_and_prng_usable(
        tiny_server: RunningServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure no sequence can be blamed for (the whole step raised, after poisoning
    the PRNG) fails the step's requests; the next sampled request works."""
    sched = tiny_server.ctx.manager.get("tiny").engine.scheduler
    real_next = sched.decoder.next

    def boom() -> Any:
        try:
            _broken_sampler(mx.zeros((1, 8)))
        finally:
            monkeypatch.setattr(sched.decoder, "next", real_next)

    monkeypatch.setattr(sched.decoder, "next", boom)
    path, body = _chat(temperature=0.7)
    assert http.post(path, json=body).status_code == 500
    assert_still_serves(http)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**70])
def test_seeds_outside_64_bits_are_400s_in_every_api(http: httpx.Client, seed: int) -> None:
    requests = [_chat(seed=seed), _completion(seed=seed),
                ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                   "seed": seed})]
    for path, body in requests:
        r = http.post(path, json=body, timeout=30)  # a hang here was the bug
        assert_openai_error(r, 400, "seed", param="seed")
    path, body = _chat(seed=2**64 - 1, n=2, temperature=0.7)  # the largest seed, and seed + 1
    assert http.post(path, json=body, timeout=60).status_code == 200
    assert_still_serves(http)


def test_a_sequence_whose_setup_fails_releases_its_lease(tiny_server: RunningServer,
                                                         http: httpx.Client,
                                                         faults: None) -> None:
    path, body = _chat(temperature=0.7, top_k=BROKEN_SETUP)
    r = http.post(path, json=body, timeout=60)
    assert r.status_code == 500 and "injected" in r.text
    deadline = time.monotonic() + 30
    residency = tiny_server.ctx.manager.get("tiny")
    while residency.leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not residency.leases


# -- B4: refused input costs almost nothing -------------------------------------------------

def _post_measured(http: httpx.Client, path: str, body: bytes) -> tuple[httpx.Response, float]:
    """POST ``body`` and return the response and this process's (the server's) peak
    RSS growth meanwhile, in MB."""
    status = Path("/proc/self/status")

    def kb(field: str) -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = kb("VmRSS:")
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    return r, (kb("VmHWM:") - base) / 1024


def test_a_huge_prompt_is_refused_quickly_without_tokenising_it(http: httpx.Client) -> None:
    words = "lorem ipsum dolor sit amet " * (20 * 1024 * 1024 // 27)  # 20 MB
    bodies = [json.dumps({"model": "tiny", "max_tokens": 2,
                          "messages": [{"role": "user", "content": words}]}).encode(),
              json.dumps({"model": "tiny", "max_tokens": 2, "prompt": words}).encode()]
    del words
    for path, body in zip(["/v1/chat/completions", "/v1/completions"], bodies):
        start = time.monotonic()
        r, growth = _post_measured(http, path, body)
        elapsed = time.monotonic() - start
        err = assert_openai_error(r, 400, "maximum context length")
        assert err["code"] == "context_length_exceeded"
        assert growth < 1024, growth  # was ~3 GB for one such prompt
        assert elapsed < 20, elapsed  # was 20-45 s; generous for a loaded 2-core machine
    assert_still_serves(http)


def test_a_prompt_under_the_character_bound_is_counted_in_chunks(
        tiny_server: RunningServer, http: httpx.Client) -> None:
    engine = tiny_server.ctx.manager.get("tiny").engine
    tok = engine.tokenizer
    # Many tokens in few characters would pass the character bound: counted in
    # chunks, it is refused without being tokenised whole.
    text = "lorem ipsum " * 10_000  # 120k characters, ~20k tokens, under the bound
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 2})
    err = assert_openai_error(r, 400, "more than 2048 tokens", param="prompt")
    assert err["code"] == "context_length_exceeded"
    # A long prompt that fits is not refused: the longest token, repeated.
    vocab = tok.get_vocab()
    longest = max(vocab, key=lambda t: len(tok.decode([vocab[t]])))
    piece = tok.decode([vocab[longest]])
    text = piece * (70_000 // len(piece) + 1)
    n = len(tok.encode(text, add_special_tokens=True))
    assert len(text) > 65_536 and n < 2000, (len(text), n)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory,
             test_home: Path) -> Iterator[RunningServer]:
    """The starter embedding model and a tiny cross-encoder reranker."""
    from mlxd.models.spec import ModelEntry
    from mlxd.models.starter import STARTER_EMBEDDING
    from tests.helpers.cross_encoders import build_tiny_roberta
    from tests.helpers.retrieval import registry_config
    from tests.helpers.server import running_server

    tmp = tmp_path_factory.mktemp("hostile-encoders")
    entries = [STARTER_EMBEDDING.model_copy(),
               ModelEntry(name="ce", source=str(build_tiny_roberta(tmp / "ce")))]
    with running_server(registry_config(tmp / "models.yaml", entries, test_home)) as srv:
        yield srv


def test_encoder_token_ids_outside_the_vocabulary_are_400s(encoders: RunningServer) -> None:
    from mlxd.models.starter import STARTER_EMBEDDING

    with encoders.client() as http:
        for token in WORST_IDS[2:]:  # MiniLM's vocabulary is 30522
            r = http.post("/v1/embeddings", json={"model": STARTER_EMBEDDING.name,
                                                  "input": [[101, token]]})
            assert_openai_error(r, 400, "", param="input")
        r = http.post("/v1/embeddings", json={"model": STARTER_EMBEDDING.name,
                                              "input": [[101, 30521]]})
        assert r.status_code == 200, r.text


def test_huge_encoder_inputs_are_cut_before_tokenising(encoders: RunningServer) -> None:
    """Embedding and rerank inputs are truncated to the model's length; the tokenizer
    used to encode all of a huge input first (~160 bytes per character)."""
    from mlxd.models.starter import STARTER_EMBEDDING

    head = "rivers and bridges of the old town " * 200  # well past 256 tokens
    huge = head + "lorem ipsum dolor " * (8 * 1024 * 1024 // 18)
    embed = {"model": STARTER_EMBEDDING.name}
    rerank = {"model": "ce", "query": "bridges"}
    with encoders.client() as http:
        for path, body in [("/v1/embeddings", {**embed, "input": [head]}),
                           ("/v1/rerank", {**rerank, "documents": [head]})]:
            small = http.post(path, json=body)  # also loads the model
            assert small.status_code == 200, small.text
            big_body = json.dumps({**body, **({"input": [huge]} if "input" in body
                                              else {"documents": [huge]})}).encode()
            start = time.monotonic()
            big, growth = _post_measured(http, path, big_body)
            assert big.status_code == 200, big.text
            assert growth < 512, growth  # was 1.3 GB (embeddings), 1.5 GB (rerank)
            assert time.monotonic() - start < 20
            if path == "/v1/embeddings":  # the same tokens, so the same vector
                assert big.json()["usage"] == small.json()["usage"]
                assert big.json()["data"][0]["embedding"] == pytest.approx(
                    small.json()["data"][0]["embedding"], abs=1e-5)
            else:
                assert big.json()["results"][0]["relevance_score"] == pytest.approx(
                    small.json()["results"][0]["relevance_score"], abs=1e-5)
