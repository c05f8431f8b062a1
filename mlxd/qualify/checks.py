"""The checks ``mlxd model qualify`` runs against a server's real HTTP endpoints.

Each check is one function taking an ``httpx.Client`` (base URL and key set)
and returning a ``CheckResult``; nothing here imports MLX or the server, so
the same checks run against an in-process server or a remote ``--url``.
Bundled inputs: a public-domain prose text (perplexity; its words shuffled as
the control) and sentence triples / rerank sets (``mlxd/data``).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import httpx

CHAT_QUESTION = "What is the capital of France? Answer in one short sentence."
CHAT_EXPECTED = "paris"


@dataclass
class CheckResult:
    """The outcome of one check: passed (None = skipped), a one-line detail, figures."""

    name: str
    passed: bool | None
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "detail": self.detail, "figures": self.figures,
                "seconds": round(self.seconds, 3)}


@dataclass
class QualifyOptions:
    """Thresholds and switches of a qualification run."""

    max_perplexity: float = 60.0
    min_perplexity_ratio: float = 8.0
    min_ordering_accuracy: float = 0.9
    check_json: bool = False
    check_tools: bool = False
    skip: frozenset[str] = frozenset()
    max_tokens: int = 32
    bench_tokens: int = 48
    bench_concurrency: int = 4
    expected_dimension: int | None = None


class CheckFailed(Exception):
    """An endpoint answered with an error; the message carries status and body."""


def bundled_text(name: str) -> str:
    """A file from ``mlxd/data``."""
    return resources.files("mlxd").joinpath("data").joinpath(name).read_text(encoding="utf-8")


def bundled_pairs() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bundled_text("qualify_pairs.json"))
    return data


def shuffled_words(text: str, seed: int = 0) -> str:
    """The same words in a seeded random order (a control with the same unigrams)."""
    words = text.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST JSON; an error status raises ``CheckFailed`` with the server's message."""
    r = client.post(path, json=body)
    if r.status_code != 200:
        raise CheckFailed(f"{path} answered {r.status_code}: {r.text[:300]}")
    data: dict[str, Any] = r.json()
    return data


def timed(name: str, fn: Any, *args: Any, **kw: Any) -> CheckResult:
    """Run one check function, turning endpoint errors into a failed result."""
    t0 = time.perf_counter()
    try:
        result: CheckResult = fn(*args, **kw)
    except (CheckFailed, httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        result = CheckResult(name, False, f"{type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - t0
    return result


def check_load(client: httpx.Client, model: str) -> CheckResult:
    """Load the model through the server's ModelManager (POST /v1/models/load)."""
    t0 = time.perf_counter()
    card = post(client, "/v1/models/load", {"model": model})
    seconds = time.perf_counter() - t0
    ok = card.get("state") == "loaded"
    return CheckResult("load", ok, f"state {card.get('state')} in {seconds:.1f}s",
                       {"load_s": round(seconds, 3), "memory_bytes": card.get("memory_bytes"),
                        "kind": card.get("kind")})


# -- text -----------------------------------------------------------------------------
COMPLETION_PROMPT = "The capital of France is"
NO_TEMPLATE = "no chat template"


def text_body(api: str, model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy request: the capital question (chat) or its prefix (completions)."""
    body: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": max_tokens, **extra}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": CHAT_QUESTION}]
    else:
        body["prompt"] = COMPLETION_PROMPT
    return body


def _path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def _text_of(api: str, choice: dict[str, Any]) -> str:
    if api == "chat":
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def check_generate(client: httpx.Client, model: str, opts: QualifyOptions,
                   api: str = "chat") -> CheckResult:
    """A greedy answer: non-empty, with a finish reason (``chat``, or ``completion`` for
    base models without a chat template)."""
    data = post(client, _path(api), text_body(api, model, opts.max_tokens))
    choice = data["choices"][0]
    text = _text_of(api, choice)
    ok = bool(text.strip()) and choice.get("finish_reason") in ("stop", "length")
    name = "chat" if api == "chat" else "completion"
    return CheckResult(name, ok, f"{text.strip()[:120]!r} ({choice.get('finish_reason')})",
                       {"text": text, "api": api,
                        "completion_tokens": data["usage"]["completion_tokens"]})


def check_answer(first: CheckResult) -> CheckResult:
    """The greedy answer to the capital-of-France question names Paris."""
    text = str(first.figures.get("text", ""))
    ok = CHAT_EXPECTED in text.lower()
    return CheckResult("answer", ok, "mentions Paris" if ok else f"no 'Paris' in {text[:80]!r}")


def check_determinism(client: httpx.Client, model: str, opts: QualifyOptions,
                      first: CheckResult) -> CheckResult:
    """The same greedy request twice gives the same text."""
    api = str(first.figures.get("api", "chat"))
    data = post(client, _path(api), text_body(api, model, opts.max_tokens))
    again = _text_of(api, data["choices"][0])
    ok = again == first.figures.get("text")
    return CheckResult("determinism", ok, "identical greedy outputs" if ok else
                       f"outputs differ: {again[:60]!r} vs {str(first.figures.get('text'))[:60]!r}")


def read_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, float, Any]:
    """Text, time to first content and finish reason of a streamed request."""
    t0 = time.perf_counter()
    parts: list[str] = []
    ttft, finish = None, None
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise CheckFailed(f"{path} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise CheckFailed(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(piece)
                finish = choice.get("finish_reason") or finish
    return "".join(parts), ttft or 0.0, finish


def check_stream(client: httpx.Client, model: str, opts: QualifyOptions,
                 first: CheckResult) -> CheckResult:
    """Streaming (SSE) gives the same greedy text as the plain request."""
    api = str(first.figures.get("api", "chat"))
    text, ttft, finish = read_stream(client, _path(api),
                                     text_body(api, model, opts.max_tokens, stream=True))
    want = first.figures.get("text")
    ok = text == want and finish in ("stop", "length")
    return CheckResult("stream", ok, f"same text, finish {finish}" if ok else
                       f"streamed {text[:60]!r} ({finish}) != {str(want)[:60]!r}",
                       {"ttft_s": round(ttft, 4)})


def perplexity(client: httpx.Client, model: str, text: str) -> tuple[float, int]:
    """Perplexity of ``text`` from the server's prompt logprobs (echo + logprobs)."""
    data = post(client, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1,
                                            "echo": True, "logprobs": 0, "temperature": 0})
    n_prompt = int(data["usage"]["prompt_tokens"])
    lps = data["choices"][0]["logprobs"]["token_logprobs"][1:n_prompt]
    values = [float(v) for v in lps if v is not None]
    if not values:
        raise CheckFailed("no prompt logprobs in the /v1/completions answer")
    return math.exp(-sum(values) / len(values)), len(values)


def check_perplexity(client: httpx.Client, model: str,
                     opts: QualifyOptions) -> tuple[CheckResult, CheckResult]:
    """Perplexity of bundled prose (bounded) and vs the same words shuffled (a ratio)."""
    text = bundled_text("qualify_text.txt")
    ppl, n = perplexity(client, model, text)
    ppl_shuffled, _ = perplexity(client, model, shuffled_words(text))
    ratio = ppl_shuffled / ppl
    figures = {"perplexity": round(ppl, 3), "perplexity_shuffled": round(ppl_shuffled, 3),
               "perplexity_ratio": round(ratio, 3), "tokens": n}
    return (CheckResult("perplexity", ppl <= opts.max_perplexity,
                        f"{ppl:.2f} on {n} tokens (max {opts.max_perplexity:g})", figures),
            CheckResult("coherence", ratio >= opts.min_perplexity_ratio,
                        f"shuffled words are {ratio:.1f}x more perplexing "
                        f"(min {opts.min_perplexity_ratio:g}x)"))


def check_json_output(client: httpx.Client, model: str, opts: QualifyOptions) -> CheckResult:
    """Structured output: a json_schema response parses and has the required field."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    body = text_body("chat", model, 64, response_format={
        "type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    data = post(client, "/v1/chat/completions", body)
    text = data["choices"][0]["message"].get("content") or ""
    value = json.loads(text)
    ok = isinstance(value, dict) and isinstance(value.get("city"), str)
    return CheckResult("json", ok, f"{text[:80]}")


def check_tool_call(client: httpx.Client, model: str, opts: QualifyOptions) -> CheckResult:
    """A forced tool call names the tool and carries JSON arguments."""
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    body = {"model": model, "temperature": 0, "max_tokens": 64, "tools": [tool],
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    data = post(client, "/v1/chat/completions", body)
    calls = data["choices"][0]["message"].get("tool_calls") or []
    if not calls:
        return CheckResult("tools", False, "no tool call in the answer")
    fn = calls[0]["function"]
    args = json.loads(fn.get("arguments") or "{}")
    ok = fn.get("name") == "get_weather" and isinstance(args.get("city"), str)
    return CheckResult("tools", ok, f"{fn.get('name')}({fn.get('arguments')})")


# -- embeddings and rerank ----------------------------------------------------------------
def embed(client: httpx.Client, model: str, texts: list[str]) -> list[list[float]]:
    data = post(client, "/v1/embeddings", {"model": model, "input": texts})
    rows = sorted(data["data"], key=lambda d: d["index"])
    return [list(map(float, r["embedding"])) for r in rows]


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def check_embeddings(client: httpx.Client, model: str, opts: QualifyOptions) -> list[CheckResult]:
    """Dimension, normalisation, similarity ordering and batch/alone consistency."""
    triples = bundled_pairs()["embedding_triples"]
    texts = [t for triple in triples for t in triple]
    vectors = embed(client, model, texts)
    dims = {len(v) for v in vectors}
    dim = next(iter(dims)) if len(dims) == 1 else None
    dim_ok = dim is not None and dim > 0 and opts.expected_dimension in (None, dim)
    norms = [math.sqrt(sum(x * x for x in v)) for v in vectors]
    worst = max(abs(n - 1.0) for n in norms)
    margins = []
    for i in range(len(triples)):
        a, p, n = vectors[3 * i: 3 * i + 3]
        margins.append(_cos(a, p) - _cos(a, n))
    accuracy = sum(m > 0 for m in margins) / len(margins)
    alone = embed(client, model, [texts[0]])[0]
    drift = max(abs(x - y) for x, y in zip(alone, vectors[0]))
    return [
        CheckResult("dimension", dim_ok, f"{dim} dimensions"
                    + (f" (expected {opts.expected_dimension})" if opts.expected_dimension else ""),
                    {"dimension": dim}),
        CheckResult("normalisation", worst < 1e-3, f"max |norm - 1| = {worst:.2e}",
                    {"max_norm_error": worst}),
        CheckResult("ordering", accuracy >= opts.min_ordering_accuracy,
                    f"{accuracy:.0%} of {len(margins)} triples ordered "
                    f"(min {opts.min_ordering_accuracy:.0%})",
                    {"ordering_accuracy": accuracy,
                     "mean_margin": round(sum(margins) / len(margins), 4)}),
        CheckResult("batch_consistency", drift < 1e-3, f"max |alone - batched| = {drift:.2e}",
                    {"max_batch_drift": drift}),
    ]


def check_rerank(client: httpx.Client, model: str, opts: QualifyOptions) -> list[CheckResult]:
    """The relevant document of each bundled set ranks first."""
    sets = bundled_pairs()["rerank_sets"]
    hits = 0
    for s in sets:
        data = post(client, "/v1/rerank", {"model": model, "query": s["query"],
                                           "documents": s["documents"]})
        results = data["results"]
        top = max(results, key=lambda r: r["relevance_score"])
        hits += int(top["index"] == s["relevant"])
    accuracy = hits / len(sets)
    return [CheckResult("ordering", accuracy >= opts.min_ordering_accuracy,
                        f"relevant document first in {hits}/{len(sets)} sets",
                        {"ordering_accuracy": accuracy})]


def bench_encoder(client: httpx.Client, model: str, kind: str) -> CheckResult:
    """Throughput of the embedding / rerank endpoint on the bundled sentences."""
    pairs = bundled_pairs()
    texts = [t for triple in pairs["embedding_triples"] for t in triple]
    t0 = time.perf_counter()
    rounds = 3
    for _ in range(rounds):
        if kind == "embedding":
            embed(client, model, texts)
        else:
            post(client, "/v1/rerank", {"model": model, "query": texts[0], "documents": texts})
    seconds = time.perf_counter() - t0
    rate = rounds * len(texts) / seconds
    return CheckResult("bench", True, f"{rate:.1f} texts/s",
                       {"texts_per_s": round(rate, 2), "batch": len(texts)})
