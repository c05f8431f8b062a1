"""Vision benchmark (issue 11): image chat requests against mlxd, mlx-vlm's own server and
vllm-mlx 0.6.0, one after another on the same model, same run.

The model is a qwen2_vl of realistic shape with random weights (about 250M parameters;
``--quick``: a small one), built offline by ``tests/helpers/tiny_vlm.py``. Each request
sends its own image (a data: URL, so every request runs the vision tower) and streams
``--max-tokens`` tokens at temperature 0. Reported per contender: aggregate tok/s and
TTFT at concurrency 1 and 4, and turn-2 TTFT: a second turn about the same image (the
first turn's answer in the history) against the first turn's TTFT.

mlxd runs twice: ``mlxd`` with prompt-lookup speculation forced on (``--speculative
prompt-lookup``: what ``auto`` picks on a GPU or with a fast BLAS) and ``mlxd-plain``
with it off. The c4 comparison of the two is reported with the drafts accepted and
whether every answer came out the same (it must, at temperature 0). A random-weight
model repeats itself, which drafts well and so flatters the speed-up: read it as an
upper bound, not what a trained model describing a photo would get.

    python -m bench.vision [--quick] [--servers mlxd,mlxd-plain,mlx_vlm.server,vllm-mlx]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import ServerProcess, ServerSpec, free_port, subprocess_env, write_report

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ("mlxd", "mlxd-plain", "mlx_vlm.server", "vllm-mlx")
# mlxd's speculation per contender (``--speculative``)
MLXD_SPECULATIVE = {"mlxd": "prompt-lookup", "mlxd-plain": "off"}
SERVED = "bench-vlm"
FULL_SHAPE = dict(hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816,
                  vision_hidden=768, vision_layers=12, vision_heads=12,
                  qwen_max_pixels=224 * 224)
QUICK_SHAPE = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                   vision_hidden=128, vision_layers=2, vision_heads=4,
                   qwen_max_pixels=112 * 112)
QUESTION = "Describe this image in detail."


def build_model(home: Path, quick: bool) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny_vlm import build_tiny_vlm

    name = "qwen2_vl-bench-quick" if quick else "qwen2_vl-bench"
    root = home / "bench-models"
    return build_tiny_vlm("qwen2_vl", root / name, root / "tokenizers",
                          **(QUICK_SHAPE if quick else FULL_SHAPE))


def image_url(seed: int, size: int = 224) -> str:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def spec(name: str, folder: Path, port: int, home: Path) -> ServerSpec:
    host = ("--host", "127.0.0.1", "--port", str(port))
    if name in MLXD_SPECULATIVE:
        return ServerSpec(name, (sys.executable, "-m", "mlxd", "serve", str(folder), *host,
                                 "--served-model-name", SERVED, "--no-starter", "--home",
                                 str(home), "--log-level", "warning",
                                 "--speculative", MLXD_SPECULATIVE[name]), SERVED)
    if name == "mlx_vlm.server":
        return ServerSpec(name, (sys.executable, "-m", "mlx_vlm.server", "--model", str(folder),
                                 *host), str(folder), "/health")
    from bench.peers import ensure_vllm_mlx

    return ServerSpec(name, (str(ensure_vllm_mlx()), "serve", str(folder), *host,
                             "--continuous-batching", "--served-model-name", SERVED),
                      SERVED, "/health")


async def chat(client: httpx.AsyncClient, url: str, model: str,
               messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed request: TTFT, tokens (usage when given, else content chunks), text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, chunks, text, usage = None, 0, "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    chunks += 1
                    text += piece
    tokens = int(usage["completion_tokens"]) if usage else chunks
    details = (usage or {}).get("completion_tokens_details") or {}
    return {"ttft_s": ttft, "tokens": tokens, "text": text,
            "seconds": time.perf_counter() - start,
            "accepted": int(details.get("accepted_prediction_tokens") or 0)}


def user_turn(url: str, text: str = QUESTION) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


async def level(url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                seed: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        async def one(i: int) -> dict[str, Any]:
            async with sem:
                return await chat(client, url, model, [user_turn(image_url(seed + i))],
                                  max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*[one(i) for i in range(requests)])
        wall = time.perf_counter() - start
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens,
            "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "drafts_accepted": sum(r["accepted"] for r in results),
            "texts": [r["text"] for r in results]}


async def first_token(client: httpx.AsyncClient, url: str, model: str,
                      messages: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """Seconds to the first token (a one-token request: the prompt's processing and
    prefill plus one sampled token), and the request's usage."""
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - start, r.json().get("usage") or {}


async def second_turn(url: str, model: str, max_tokens: int, seed: int) -> dict[str, Any]:
    """Turn 1 about a new image, then turn 2 about the same image with turn 1's answer in
    the history (median of 3 pairs).

    Each TTFT is a one-token request on the conversation as it stands: a streamed first
    chunk waits for the first printable text, which a random-weight model may not produce
    for dozens of tokens (measured: turn 2's first chunk came with its last token, 65 s).
    The turn-1 answer the history carries comes from a full request in between.
    """
    pairs = []
    resumed: list[tuple[int | None, int | None]] = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        for i in range(3):
            picture = image_url(seed + 1000 + i)
            t1, _ = await first_token(client, url, model, [user_turn(picture)])
            first = await chat(client, url, model, [user_turn(picture)], max_tokens)
            history = [user_turn(picture), {"role": "assistant", "content": first["text"]},
                       {"role": "user", "content": "And what else is in it?"}]
            t2, usage = await first_token(client, url, model, history)
            pairs.append((t1, t2))
            # how much of turn 2 the server resumed (None: it does not say)
            details = usage.get("prompt_tokens_details") or {}
            resumed.append((details.get("cached_tokens"), usage.get("prompt_tokens")))
    t1 = statistics.median(p[0] for p in pairs)
    t2 = statistics.median(p[1] for p in pairs)
    return {"turn1_ttft_s": t1, "turn2_ttft_s": t2, "speedup": t1 / t2 if t2 else None,
            "pairs": pairs, "turn2_cached_of_prompt_tokens": resumed}


def run_contender(name: str, folder: Path, args: argparse.Namespace,
                  env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    try:
        s = spec(name, folder, port, args.home)
        log = args.out / "logs" / f"vision-{name}.log"
        with ServerProcess(s, port, env, log) as srv:
            out: dict[str, Any] = {"started_in_s": srv.started_in_s, "levels": []}
            asyncio.run(level(srv.url, s.model, 1, 1, 4, seed=1))  # warm-up
            for c in (1, 4):
                out["levels"].append(asyncio.run(level(
                    srv.url, s.model, c, args.requests * (1 if c == 1 else 2),
                    args.max_tokens, seed=100 * c)))
            out["turn2"] = asyncio.run(second_turn(srv.url, s.model, args.max_tokens, seed=7))
            return out
    except Exception as e:  # a contender that cannot start is reported; the others still run
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Vision benchmark ({results['mode']}, {results['started_at']})", "",
             f"Model: {results['model']}; {results['workload']}", "",
             "| server | c1 tok/s | c1 TTFT p50 | c4 tok/s | c4 TTFT p50 | turn-1 TTFT | "
             "turn-2 TTFT | turn-2 speed-up |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["servers"].items():
        if r.get("error"):
            lines.append(f"| {name} | error: {r['error'].splitlines()[0][:80]} |||||||")
            continue
        c1, c4 = r["levels"]
        t = r["turn2"]

        def f(x: float | None, unit: str = "") -> str:
            return "-" if x is None else f"{x:.2f}{unit}"

        lines.append(f"| {name} | {f(c1['aggregate_tok_s'])} | {f(c1['ttft_p50_s'], ' s')} | "
                     f"{f(c4['aggregate_tok_s'])} | {f(c4['ttft_p50_s'], ' s')} | "
                     f"{f(t['turn1_ttft_s'], ' s')} | {f(t['turn2_ttft_s'], ' s')} | "
                     f"{f(t['speedup'], 'x')} |")
    lines += speculation_lines(results["servers"])
    return "\n".join(lines) + "\n"


def speculation_lines(servers: dict[str, Any]) -> list[str]:
    """mlxd at c4 with prompt-lookup speculation against mlxd without it (when both ran)."""
    on, off = servers.get("mlxd") or {}, servers.get("mlxd-plain") or {}
    if not on.get("levels") or not off.get("levels"):
        return []
    fast, plain = on["levels"][1], off["levels"][1]
    same = fast["texts"] == plain["texts"]
    drafted = fast["drafts_accepted"] / max(1, fast["tokens"])
    return ["", "Speculation at c4 (mlxd, prompt lookup, against mlxd with it off): "
            f"{fast['aggregate_tok_s'] / plain['aggregate_tok_s']:.2f}x aggregate tok/s; "
            f"{fast['drafts_accepted']} of {fast['tokens']} tokens were accepted drafts "
            f"({drafted:.0%}); answers identical: {'yes' if same else 'NO'}. A random-weight "
            "model repeats itself, which flatters acceptance."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model, fewer requests")
    p.add_argument("--servers", default=",".join(CONTENDERS))
    p.add_argument("--requests", type=int, default=None, help="requests at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    args.requests = args.requests or (2 if args.quick else 4)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    unknown = set(args.servers.split(",")) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contenders: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tag = args.tag or ("vision_quick" if args.quick else "vision")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    folder = build_model(args.home, args.quick)
    env, _ = subprocess_env("auto")
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"{folder.name} (qwen2_vl, random weights)",
        "workload": f"one 224x224 PNG per request, {args.max_tokens} output tokens, "
                    "temperature 0, streamed", "servers": {}}
    for name in args.servers.split(","):
        print(f"--- {name}", flush=True)
        results["servers"][name] = run_contender(name, folder, args, env)
    write_report(args.out, tag, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
