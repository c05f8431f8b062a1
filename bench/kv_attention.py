"""One attention layer over quantized KV on CPU: mlx-lm's path against mlxd's, in one process.

``python -m bench.kv_attention [--bits 8] [--rounds 2]``: SmolLM2-135M's attention shape
(9 query heads, 3 KV heads of 64, float32), prefill chunks (256 queries) and decode steps
(1 query, 1-8 rows) against 1k-6k cached tokens. Per call, ms (best of ``--rounds``
rounds, the variants interleaved in each): ``upstream`` is mlx-lm's
``quantized_scaled_dot_product_attention``, ``mlxd`` the CPU path a loaded model takes
(``engines/kernels/quantized_attention.py`` through ``prefill._cpu_sdpa``), ``float`` the
same call over float32 KV (no ``--kv-bits``). Run with OpenBLAS preloaded
(``LD_PRELOAD``) to match a server.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

HEADS, KV_HEADS, HEAD_DIM, GROUP = 9, 3, 64, 64
CASES = [(1, 256, n) for n in (1024, 2048, 4096, 6144)] + [
    (rows, 1, n) for rows in (1, 4, 8) for n in (1024, 2048, 4096, 6144)]


def _ms(f: Any, reps: int) -> float:
    import mlx.core as mx

    mx.eval(f())
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2] * 1e3


def case(rows: int, queries: int, keys: int, bits: int, rounds: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from mlxd.engines.kernels import prefill

    k1, k2, k3 = mx.random.split(mx.random.key(keys + queries), 3)
    q = mx.random.normal((rows, HEADS, queries, HEAD_DIM), key=k1)
    k = mx.random.normal((rows, KV_HEADS, keys, HEAD_DIM), key=k2)
    v = mx.random.normal((rows, KV_HEADS, keys, HEAD_DIM), key=k3)
    qk, qv = (mx.quantize(x, group_size=GROUP, bits=bits) for x in (k, v))
    mx.eval(q, k, v, *qk, *qv)
    mask = "causal" if queries > 1 else None
    scale = HEAD_DIM ** -0.5
    quantized = QuantizedKVCache(group_size=GROUP, bits=bits)
    variants = {
        "upstream": lambda: base.quantized_scaled_dot_product_attention(
            q * 1, qk, qv, scale=scale, mask=mask, group_size=GROUP, bits=bits),
        "mlxd": lambda: prefill._cpu_sdpa(q, qk, qv, quantized, scale, mask),
        "float": lambda: prefill._cpu_sdpa(q, k, v, KVCache(), scale, mask)}
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, f in variants.items():
            t = _ms(f, 5 if queries > 1 else 15)
            best[name] = min(best.get(name, t), t)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, choices=(4, 8), default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    import os

    from mlx_lm.utils import load

    from bench.model import smollm2_float32
    from mlxd.config import default_home
    from mlxd.engines.kernels import prefill

    # a loaded model installs the CPU path (and its thread pool), as a server does
    model, _ = load(str(smollm2_float32(default_home())))[:2]
    handle = prefill.install_cpu_prefill_attention(model)
    print(f"bits {args.bits}, CPU path installed: {handle is not None}, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, "
          f"load average {os.getloadavg()[0]:.1f}; ms per call")
    print("| rows x queries x keys | upstream | mlxd | float | mlxd speedup |")
    print("|---|---:|---:|---:|---:|")
    for rows, queries, keys in CASES:
        r = case(rows, queries, keys, args.bits, args.rounds)
        print(f"| {rows} x {queries} x {keys:,} | {r['upstream']:.2f} | {r['mlxd']:.2f} | "
              f"{r['float']:.2f} | {r['upstream'] / r['mlxd']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
