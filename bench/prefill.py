"""Cold prefill on CPU: mlxd's path vs the one before it, side by side in one process.

``python -m bench.prefill [--tokens 2000] [--reps 1] [--json out.json]`` on the
SmolLM2-135M float32 folder ``make bench`` serves. Variants (each a cold
cache, prompt run chunk by chunk as ``BatchGenerator`` prefills it, logits
left unevaluated as there):

- ``before``: chunks of 2,048 tokens, mlx-lm's attention and SwiGLU (mlxd before
  engines/kernels/prefill.py);
- ``chunked``: chunks of ``CPU_PREFILL_CHUNK``, mlx-lm's attention and SwiGLU;
- ``mlxd``: chunks of ``CPU_PREFILL_CHUNK``, NumPy attention and the base-2 SwiGLU (engines/kernels/prefill.py).

Also measured: this CPU's sgemm rate on a prefill-shaped matmul, and the
time the prompt's matmul FLOPs (weights and causal attention) would take at
that rate: the sgemm bound. Run under ``bench.run`` it gets the same BLAS
as the servers (OpenBLAS preloaded when installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

OLD_CHUNK = 2048


def _sgemm_gflops(rows: int, hidden: int, inner: int) -> float:
    import mlx.core as mx

    a, b = mx.random.normal((rows, hidden)), mx.random.normal((hidden, inner))
    mx.eval(a, b)
    mx.eval(a @ b)
    tic = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ b)
    return 2 * rows * hidden * inner * 3 / (time.perf_counter() - tic) / 1e9


def _matmul_gflop(model: Any, args: dict[str, Any], tokens: int) -> float:
    """Weights (no embedding lookup; the lm_head is skipped in prefill) + causal attention."""
    from mlx.utils import tree_flatten

    flat: list[tuple[str, Any]] = list(tree_flatten(model.parameters()))  # type: ignore[arg-type]
    weights = sum(v.size for k, v in flat
                  if k.endswith("weight") and v.ndim == 2 and "embed" not in k)
    heads = args["num_attention_heads"]
    head_dim = args.get("head_dim") or args["hidden_size"] // heads
    attention = 2 * 2 * heads * head_dim * tokens * tokens / 2 * args["num_hidden_layers"]
    return (2 * weights * tokens + attention) / 1e9


def _prefill(model: Any, tokens: Any, chunk: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tic = time.perf_counter()
    for start in range(0, tokens.shape[1], chunk):
        model(tokens[:, start:start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - tic


def measure(folder: Path, n_tokens: int, reps: int) -> dict[str, Any]:
    """Seconds per variant (median of ``reps``, variants interleaved) and the bounds."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxd.engines.kernels import prefill as ours

    model, _, config = cast(tuple[Any, Any, dict[str, Any]],
                            load(str(folder), return_config=True))
    module: Any = sys.modules[type(model).__module__]
    mx.random.seed(0)
    tokens = mx.random.randint(0, int(config["vocab_size"]), (1, n_tokens))
    _prefill(model, tokens[:, :64], 64)  # warm up
    variants = {"before": (OLD_CHUNK, False), "chunked": (ours.CPU_PREFILL_CHUNK, False),
                "mlxd": (ours.CPU_PREFILL_CHUNK, True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, (chunk, cpu_path) in variants.items():
            for attr, upstream, _ in ours.PATHS:  # mlx-lm's attention and SwiGLU
                setattr(module, attr, upstream)
            if cpu_path:
                ours.install_cpu_prefill_attention(model)
            times[name].append(_prefill(model, tokens, chunk))
            print(f"{name}: {times[name][-1]:.2f}s", flush=True)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    gflops = _sgemm_gflops(min(n_tokens, OLD_CHUNK), int(config["hidden_size"]),
                           int(config["intermediate_size"]))
    work = _matmul_gflop(model, config, n_tokens)
    return {"tokens": n_tokens, "seconds": seconds,
            "tokens_per_s": {k: n_tokens / v for k, v in seconds.items()},
            "speedup_vs_before": seconds["before"] / seconds["mlxd"],
            "sgemm_gflops": gflops, "matmul_gflop": work, "sgemm_bound_s": work / gflops,
            "mlxd_vs_bound": seconds["mlxd"] / (work / gflops)}


def markdown(r: dict[str, Any]) -> str:
    """The result as a table for ``bench/results``."""
    rows = [f"| {k} | {v:.2f} | {r['tokens_per_s'][k]:.0f} |" for k, v in r["seconds"].items()]
    return "\n".join([
        f"### Cold prefill, {r['tokens']} tokens (SmolLM2-135M float32, CPU)", "",
        "| variant | seconds | tokens/s |", "|---|---:|---:|", *rows, "",
        f"mlxd vs before: {r['speedup_vs_before']:.2f}x. sgemm {r['sgemm_gflops']:.1f} GFLOP/s; "
        f"the prompt's {r['matmul_gflop']:.0f} GFLOP of matmuls need {r['sgemm_bound_s']:.2f} s "
        f"at that rate: mlxd takes {r['mlxd_vs_bound']:.1f}x the sgemm bound.", ""])


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--folder", type=Path, default=None, help="model folder (default SmolLM2)")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    folder = args.folder or smollm2_float32(args.home)
    result = measure(folder, args.tokens, max(1, args.reps))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
