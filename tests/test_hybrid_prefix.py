"""Hybrid (attention + recurrent) models: batched decoding is exact, and a
conversation's turns resume from checkpoints of the previous turn, batched
and serial, with the same greedy tokens as a cold run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.config import ServerConfig
from tests.helpers.server import running_server
from tests.helpers.tiny_hybrids import ARCHITECTURES, build_hybrid

SYSTEM = "You are a coding agent. " + " ".join(f"Tool {i} reads file number {i}."
                                                for i in range(20))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def hybrid(request: pytest.FixtureRequest, session_dir: Path, tiny_model: Path) -> Path:
    out = session_dir / f"tiny-{request.param}"
    if not (out / "config.json").exists():
        build_hybrid(out, request.param, tiny_model)
    return out


def _decode(model: Any, prompts: list[list[int]], caches: list[Any], prefill_batch: int,
            max_tokens: int = 10) -> list[list[int]]:
    """Greedy tokens for ``prompts`` decoded together; ``caches[i]`` = (cache, n_cached)."""
    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
    from mlxd.engines.text.sampling import greedy

    decoder = LMBatchDecoder(model, eos_ids=[], max_num_seqs=8, prefill_step_size=64,
                             prefill_batch_size=prefill_batch)
    uids = [decoder.insert(SimpleNamespace(tokens=p), n, c, greedy, [], set(),  # type: ignore[arg-type]
                           max_tokens) for p, (c, n) in zip(prompts, caches)]
    out: dict[int, list[int]] = {u: [] for u in uids}
    while sum(len(v) for v in out.values()) < max_tokens * len(uids):
        for r in decoder.next()[1]:
            out[r.uid].append(r.token)
    decoder.close()
    return [out[u] for u in uids]


def test_batched_equals_alone(hybrid: Path) -> None:
    """Prompts of different lengths, one resuming from a cached state of its prefix,
    decode in one batch to the tokens each gets alone."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engines.text.hybrid_cache import prefill, prefill_batch_size, snapshot

    model, _, config = load(str(hybrid), return_config=True)
    batch = prefill_batch_size(config["model_type"], make_prompt_cache(model), 8)
    mx.random.seed(1)
    prompts = [mx.random.randint(0, 2000, (n,)).tolist() for n in (100, 7, 150, 40)]
    prefix = make_prompt_cache(model)
    prefill(model, prefix, prompts[0][:70], 64)
    resumed = (snapshot(prefix), 70)
    alone = [_decode(model, [p], [(None, 0)], batch)[0] for p in prompts]
    assert _decode(model, prompts[:1], [resumed], batch) == alone[:1]
    together = _decode(model, prompts, [resumed] + [(None, 0)] * 3, batch)
    assert together == alone


@pytest.fixture(scope="module", params=["batched", "serial"])
def server(request: pytest.FixtureRequest, hybrid: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Any]:
    # the batched server speculates (prompt lookup; Nemotron-H's Mamba-2 layers cannot be
    # rewound, so it decodes plainly): checkpoints stay exact under verify steps
    cfg = ServerConfig(model=str(hybrid), served_model_name="m", no_starter=True,
                       home=tmp_path_factory.mktemp("hybrid-home"),
                       batching=request.param == "batched", prefix_cache_bytes=64 * 2**20,
                       speculative="prompt-lookup" if request.param == "batched" else "off")
    with running_server(cfg) as srv, srv.client() as http:
        yield http


def _chat(http: Any, messages: list[dict], salt: str | None = None) -> dict:
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 12,
                            "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_turns_resume_from_the_previous_turn(server: Any, request: pytest.FixtureRequest) -> None:
    http = server
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    previous_prompt, prompts, drafted = 0, [], 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Now edit function number {turn}."})
        warm = _chat(http, messages)
        cold = _chat(http, messages, salt=uuid.uuid4().hex)  # a namespace with nothing cached
        usage = warm["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if turn:
            assert cached >= 0.9 * previous_prompt, (turn, cached, previous_prompt)
        assert warm["choices"][0]["message"]["content"] == \
            cold["choices"][0]["message"]["content"]
        assert usage["completion_tokens"] == cold["usage"]["completion_tokens"]
        details = usage.get("completion_tokens_details") or {}
        drafted += details.get("accepted_prediction_tokens", 0)
        previous_prompt = usage["prompt_tokens"]
        prompts.append(previous_prompt)
        # A leading newline merges with the template's "assistant\n" into one token: the
        # next prompt shares all of this one but its last token.
        answer = "\n" + warm["choices"][0]["message"]["content"].lstrip("\n")
        messages.append({"role": "assistant", "content": answer})
    # The same prompt again resumes from the nearest checkpoint before its last token
    # (a recurrent state cannot be cut back to leave that token to process).
    again = _chat(http, messages[:-1])["usage"]
    assert prompts[-2] <= again["prompt_tokens_details"]["cached_tokens"] < prompts[-1]
    # gated delta-net hybrids speculate when batched (their recurrent layers are replayed)
    params = request.node.callspec.params
    speculates = params["server"] == "batched" and params["hybrid"] != "nemotron_h"
    assert http.get("/v1/models/m").json()["speculative"] == \
        ("prompt-lookup" if speculates else "off")
    assert (drafted > 0) == speculates, drafted


TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Reads file number {i} of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}} for i in range(4)]


def test_a_new_conversation_resumes_from_the_shared_system_prompt(server: Any) -> None:
    """Sessions share a system prompt and tools: a second conversation resumes from the
    checkpoint where the first one's system messages ended (a recurrent state cannot be
    cut back to it), with the same greedy tokens as a cold run."""
    http = server
    system = "You are a reviewing agent. " + " ".join(f"Check {i} finds bug {i}."
                                                      for i in range(20))

    def conversation(task: str, salt: str | None = None) -> dict:
        r = http.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 12, "temperature": 0, "tools": TOOLS,
            **({"cache_salt": salt} if salt else {}),
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": task}]})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def cached(resp: dict) -> int:
        return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])

    shared = http.post("/tokenize", json={"model": "m", "tools": TOOLS, "messages": [
        {"role": "system", "content": system}]}).json()["count"]
    first = conversation("Review the parser module for off-by-one errors.")
    assert cached(first) == 0
    for task in ("Now review the lexer for unicode handling bugs.",
                 "List every file that imports the tokenizer."):
        warm, cold = conversation(task), conversation(task, salt=uuid.uuid4().hex)
        assert cached(cold) == 0
        # the whole system prompt with its tools, not the task
        assert shared - 8 <= cached(warm) < warm["usage"]["prompt_tokens"] - 4, \
            (cached(warm), shared, warm["usage"]["prompt_tokens"])
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
