"""Token endpoints for evaluation clients (issue 15 part 4): ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes, checked against the
server's own chat and completion counts, hostile token ids, and lm-evaluation-harness
run for real against the server with no tokenizer of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.helpers.retrieval import assert_openai_error
from tests.helpers.server import RunningServer

VOCAB = 2048  # tests/helpers/tiny_models.build_llama
CONTEXT = 2048
HI = [{"role": "user", "content": "hi"}]
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓ 日本語", " leading space",
         "<|im_start|>user\nspecial tokens inside<|im_end|>"]


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer) -> httpx.Client:
    return tiny_server.client()


def tokenize(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_tokenize_answers_in_vllms_shape(http: httpx.Client) -> None:
    out = tokenize(http, model="tiny", prompt=TEXTS[0], return_token_strs=True)
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) > 3
    assert out["max_model_len"] == CONTEXT
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in out["tokens"])
    assert len(out["token_strs"]) == out["count"] and all(out["token_strs"])
    # token_strs only when asked for; no model: the default one (what lm-eval sends)
    plain = tokenize(http, prompt=TEXTS[0], add_special_tokens=False)
    assert set(plain) == {"count", "max_model_len", "tokens"}
    assert plain["tokens"] == out["tokens"]  # this tokenizer adds no BOS
    assert tokenize(http, prompt="")["tokens"] == []


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_gives_the_text_back(http: httpx.Client, text: str) -> None:
    tokens = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    r = http.post("/detokenize", json={"model": "tiny", "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("extra", [
    {},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Count the tokens, please: " + TEXTS[1]}]},
    {"tools": [{"type": "function", "function": {
        "name": "lookup", "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]},
])
def test_chat_count_is_what_a_chat_completion_reports(http: httpx.Client,
                                                      extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": HI, **extra}
    counted = tokenize(http, **body)["count"]
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert counted == r.json()["usage"]["prompt_tokens"]
    # without the generation prompt the template renders less
    assert tokenize(http, **body, add_generation_prompt=False)["count"] < counted


def test_prompt_count_is_what_a_completion_reports(http: httpx.Client) -> None:
    counted = tokenize(http, model="tiny", prompt=TEXTS[0])["count"]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": TEXTS[0], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert counted == r.json()["usage"]["prompt_tokens"]


def test_tokenizer_info_has_what_lm_evals_remote_tokenizer_reads(http: httpx.Client) -> None:
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] is None
    assert info["model_max_length"] == CONTEXT and info["vocab_size"] == VOCAB
    assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]
    assert http.get("/tokenizer_info", params={"model": "tiny"}).json() == info
    # lm-eval's eos_token_id is the first id of the eos token's text
    eos = tokenize(http, prompt=info["eos_token"], add_special_tokens=False)["tokens"]
    assert len(eos) == 1


# Token ids a tokenizer must never see: out of the vocabulary, negative, past int64.
WORST_IDS: list[Any] = [-1, VOCAB, VOCAB + 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]
NOT_IDS: list[Any] = [1.5, "1", True, None, [1], {"id": 1}]


@pytest.mark.parametrize("bad", WORST_IDS + NOT_IDS, ids=repr)
def test_detokenize_refuses_ids_outside_the_vocabulary(http: httpx.Client, bad: Any) -> None:
    r = http.post("/detokenize", json={"model": "tiny", "tokens": [5, 6, bad]})
    err = assert_openai_error(r, 400)
    assert str(err["param"]).startswith("tokens"), err


def test_detokenize_refuses_more_ids_than_the_context_holds(http: httpx.Client) -> None:
    r = http.post("/detokenize", json={"tokens": [5] * (CONTEXT + 1)})
    assert_openai_error(r, 400, "context", param="tokens")
    r = http.post("/detokenize", json={"tokens": [5] * 200_000 + [VOCAB]})  # length first
    assert_openai_error(r, 400, "context", param="tokens")
    assert http.post("/detokenize", json={"tokens": [5] * CONTEXT}).status_code == 200


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "def " * 5000}, 400, "prompt"),  # more tokens than the context
    ({"prompt": "x" * 10_000_000}, 400, "prompt"),  # refused by its length, not tokenised
    ({"messages": [{"role": "user", "content": "def " * 5000}]}, 400, "messages"),
    ({"prompt": "hi", "messages": HI}, 400, None),
    ({}, 400, None),
    ({"messages": []}, 400, "messages"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ({"messages": HI, "continue_final_message": True, "add_generation_prompt": True}, 400, None),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 400, None),
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
])
def test_tokenize_refuses_bad_requests(http: httpx.Client, body: dict[str, Any], status: int,
                                       param: str | None) -> None:
    err = assert_openai_error(http.post("/tokenize", json=body), status)
    if param is not None:
        assert err["param"] == param, err


def test_server_still_serves_after_the_worst_inputs(http: httpx.Client) -> None:
    for bad in WORST_IDS:
        assert http.post("/detokenize", json={"tokens": [bad]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x" * 10_000_000}).status_code == 400
    assert tokenize(http, prompt="still here")["count"] > 0
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_token_endpoints_serve_text_models_only(mixed_server: RunningServer) -> None:
    http = mixed_server.client()
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = http.post(path, json={"model": "all-minilm-l6-v2", **body})
        assert_openai_error(r, 400, "text", param="model")
    r = http.get("/tokenizer_info", params={"model": "rerank"})
    assert_openai_error(r, 400, param="model")
    assert http.get("/tokenizer_info").json()["eos_token"] == "<|im_end|>"  # default: tiny


def test_no_model_named_and_no_default_model_is_a_400() -> None:
    """A server with no chat model has no ``default`` alias: the client must name one."""
    from mlxd.errors import InvalidRequest
    from mlxd.models.manager import ManagerPolicy, ModelManager
    from mlxd.server.routes.tokenize import model_name

    ctx: Any = SimpleNamespace(manager=ModelManager(ManagerPolicy(budget_bytes=1 << 30), None))
    with pytest.raises(InvalidRequest, match="model is required") as refused:
        model_name(ctx, None, "/tokenize")
    assert refused.value.param == "model"


# -- lm-evaluation-harness, run as a user runs it ---------------------------------------

def run_lm_eval(url: str, home: Path) -> dict[str, Any]:
    """``tests/helpers/lm_eval_runner.py`` against ``url``, offline; its runs by name."""
    from tests.helpers.lm_eval_runner import MARKER

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.lm_eval_runner", url], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARKER))
    runs: dict[str, Any] = json.loads(line[len(MARKER):])
    return runs


@pytest.mark.slow
def test_lm_eval_runs_with_nothing_but_the_url(tiny_server: RunningServer,
                                               tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is in requirements/test-reference.txt")
    runs = run_lm_eval(tiny_server.url, tmp_path / "hf")
    # local-completions: the same scores, loglikelihoods and generations twice
    assert runs["completions0"] == runs["completions1"]
    results, samples = runs["completions0"]["results"], runs["completions0"]["samples"]
    assert 0.0 <= results["mlxd_tiny_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["mlxd_tiny_gen"]
    assert len(samples["mlxd_tiny_mc"]) == 6 and len(samples["mlxd_tiny_gen"]) == 4
    assert all(generated(resps) for _, resps in samples["mlxd_tiny_gen"])
    # local-chat-completions (generate_until through the chat template)
    assert runs["chat0"] == runs["chat1"]
    chat = runs["chat0"]["samples"]["mlxd_tiny_gen"]
    assert len(chat) == 4 and all(generated(resps) for _, resps in chat)


def generated(resps: str) -> str:
    """The text of one generate_until sample's response (lm-eval's ``[[text]]``)."""
    return str(json.loads(resps)[0][0])
