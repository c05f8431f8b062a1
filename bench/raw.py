"""The ceiling with no HTTP: mlx-lm's ``batch_generate`` (BatchGenerator) and
``stream_generate`` on the same folder and the same prompts as the servers get.

Run as its own process (``python -m bench.raw``) so it sees the same BLAS
environment (``LD_PRELOAD``) as the servers and its memory is not ours.

Numbers per batch size B (B prompts inserted at once, greedy, ``max_tokens`` each):
``e2e_tok_s`` = generated tokens / wall time including prefill (what a server's
aggregate tok/s compares to), ``decode_tok_s`` = mlx-lm's own decode-only rate.
``stream_generate``: single-stream decode tok/s as mlx-lm reports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mlxd.benchmark.prompts import PromptSpec, first_messages


def prompt_ids(tokenizer: Any, spec: PromptSpec, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` chat prompts the load generator would send."""
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template(first_messages(spec, i), add_generation_prompt=True)
        out.append(list(ids))
    return out


def measure_batch(model: Any, tokenizer: Any, prompts: list[list[int]],
                  max_tokens: int) -> dict[str, Any]:
    """One ``batch_generate`` call over ``prompts``."""
    from mlx_lm.generate import batch_generate

    b = len(prompts)
    start = time.perf_counter()
    resp = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens,
                          completion_batch_size=max(b, 1), prefill_batch_size=min(b, 8))
    wall = time.perf_counter() - start
    stats = resp.stats
    return {"batch": b, "wall_s": round(wall, 3), "output_tokens": stats.generation_tokens,
            "e2e_tok_s": round(stats.generation_tokens / wall, 2),
            "decode_tok_s": round(stats.generation_tps, 2),
            "prefill_tok_s": round(stats.prompt_tps, 2),
            "prompt_tokens_mean": round(sum(map(len, prompts)) / b, 1)}


def measure_stream(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int,
                   ) -> dict[str, Any]:
    """Single-stream ``stream_generate``: mlx-lm's decode and prefill rates, TTFT."""
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    first = None
    responses = []
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if first is None:
            first = time.perf_counter() - start
        responses.append(response)
    last = responses[-1]
    return {"decode_tok_s": round(last.generation_tps, 2),
            "prefill_tok_s": round(last.prompt_tps, 2), "output_tokens": last.generation_tokens,
            "ttft_s": round(first or 0.0, 4), "wall_s": round(time.perf_counter() - start, 3)}


def run(folder: Path, batches: list[int], spec: PromptSpec, max_tokens: int) -> dict[str, Any]:
    """Load once, warm up, then measure ``stream_generate`` and each batch size."""
    from mlx_lm import load

    model, tokenizer = load(str(folder))[:2]
    prompts = prompt_ids(tokenizer, spec, max(batches))
    measure_batch(model, tokenizer, prompts[:1], 4)  # warm-up: compile, allocate
    return {"stream_generate": measure_stream(model, tokenizer, prompts[0], max_tokens),
            "batch_generate": [measure_batch(model, tokenizer, prompts[:b], max_tokens)
                               for b in batches]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.raw", description=__doc__)
    p.add_argument("folder", type=Path)
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    spec = PromptSpec(prompt_tokens=args.prompt_tokens, seed=args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    result = run(args.folder, batches, spec, args.max_tokens)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
