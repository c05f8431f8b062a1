"""Scale-out figures (docs/scaling.md): replicas behind a router, and one model on two ranks.

    python -m bench.scaling                  # both parts, ~5-10 minutes on 2 cores
    python -m bench.scaling --part replicas  # or --part sharded

``replicas``: the starter SmolLM2-135M (float32) served by one mlxd, then by two
mlxd replicas behind LiteLLM's Router (least-busy), both driven through the Router at
the same concurrency (16): aggregate completion tokens per second. On one machine the
replicas share its cores, so the ratio says what routing costs and what a second
process's batch adds there, not what a second host would add.

``sharded``: a random Llama (hidden 512, 8 layers, 8 heads; SmolLM2's 9 heads do not
split over 2 ranks and mlx-lm 0.32.2's Llama has no pipeline split) served by one rank
and by two ranks (ring backend over 127.0.0.1): decode tokens per second, and the
per-token communication cost measured directly: the time of one all_sum of a hidden
vector between the two ranks, times the all_sums a decode step makes (two per layer,
plus one carrying the sampled tokens).

Everything talks to 127.0.0.1 only. Results go to bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HIDDEN, LAYERS, HEADS = 512, 8, 8
PROBE_ITERS = 300


async def _load(router: Any, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Send ``requests`` chat requests through ``router``, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    served: dict[str, int] = {}

    async def one(i: int) -> int:
        async with gate:
            r = await router.acompletion(
                model="tiny", messages=[{"role": "user", "content": f"Write about topic {i}."}],
                max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
            base = str(r._hidden_params["api_base"])
            served[base] = served.get(base, 0) + 1
            return int(r.usage.completion_tokens)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i) for i in range(requests)]))
    wall = time.perf_counter() - start
    return {"requests": requests, "concurrency": concurrency, "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "per_replica": sorted(served.values())}


def run_replicas(home: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    from bench.model import smollm2_float32
    from tests.helpers.router import loopback_only, make_router, start_replica, wait_ready

    model = smollm2_float32(home)
    first = start_replica(model, home, logs / "replica0.log")
    second = None
    try:
        wait_ready(first)
        with loopback_only():
            one = asyncio.run(_load(make_router([first]), args.requests, args.concurrency,
                                    args.max_tokens))
            second = start_replica(model, home, logs / "replica1.log")
            wait_ready(second)
            two = asyncio.run(_load(make_router([first, second]), args.requests,
                                    args.concurrency, args.max_tokens))
    finally:
        for r in (first, second):
            if r is not None:
                r.stop()
    return {"model": "SmolLM2-135M-Instruct float32", "one_replica": one, "two_replicas": two,
            "ratio": round(two["tok_s"] / one["tok_s"], 3), "cpus": os.cpu_count()}


async def _decode(url: str, streams: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": f"def f{i}(", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await one(-1)  # warm: first-step compilation and allocation
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(i) for i in range(streams)]))
        wall = time.perf_counter() - start
    return {"streams": streams, "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 2)}


def _probe_allsum(group_port: int) -> dict[str, Any]:
    """Time one all_sum of a hidden vector between two ranks (mlx.launch, ring, loopback)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    cmd = [str(launcher), "--hosts", "127.0.0.1,127.0.0.1", "--backend", "ring",
           "--starting-port", str(group_port), "--python", sys.executable, "--",
           "-m", "bench.scaling", "--probe-rank"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE.parent,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    probe = dict(json.loads(line))
    per_step = 2 * LAYERS + 1
    probe["allsums_per_decode_step"] = per_step
    probe["comm_ms_per_token_hot"] = round(probe["allsum_ms"] * per_step, 4)
    return probe


def probe_rank() -> None:
    """Run under mlx.launch: rank 0 prints all_sum times of a hidden vector: back to back
    (both ranks hot), after 5 ms idle (a peer that must be woken, as between decode
    steps), and a chain of one decode step's all_sums with a matmul between each."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.ones((1, 1, HIDDEN))
    w = mx.random.normal((HIDDEN, HIDDEN), key=mx.random.key(0)) * 0.01

    def timed(gap_s: float, n: int) -> float:
        total = 0.0
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)  # idle between steps, as a server is between tokens
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            total += time.perf_counter() - start
        return total / n * 1000

    def chain() -> mx.array:
        h = x
        for _ in range(2 * LAYERS + 1):
            h = mx.distributed.all_sum(h @ w, group=group)
        return h

    timed(0, 20)
    mx.eval(chain())
    start = time.perf_counter()
    for _ in range(30):
        mx.eval(chain())
    chain_ms = (time.perf_counter() - start) / 30 * 1000
    figures = {"allsum_ms": round(timed(0, PROBE_ITERS), 4),
               "allsum_after_idle_ms": round(timed(0.005, 100), 4),
               "step_chain_ms": round(chain_ms, 3), "floats": HIDDEN}
    if group.rank() == 0:
        print(json.dumps(figures), flush=True)


def run_sharded(home: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tests.helpers.group import free_port_run, running_group
    from tests.helpers.router import start_replica, wait_ready
    from tests.helpers.tiny_models import build_llama

    model = build_llama(logs / "llama-512", hidden=HIDDEN, layers=LAYERS, heads=HEADS, seed=0)
    out: dict[str, Any] = {"model": f"random llama hidden {HIDDEN}, {LAYERS} layers, "
                                    f"{HEADS} heads"}
    single = start_replica(model, home, logs / "rank-single.log")
    try:
        wait_ready(single)
        out["one_rank"] = [asyncio.run(_decode(single.url, s, args.max_tokens)) for s in (1, 4)]
    finally:
        single.stop()
    with running_group(model, home, logs / "group.log") as group:
        out["two_ranks"] = [asyncio.run(_decode(group.url, s, args.max_tokens)) for s in (1, 4)]
    out["probe"] = _probe_allsum(free_port_run(3))
    one_s, two_s = out["one_rank"][0], out["two_ranks"][0]
    out["ms_per_token_one_rank"] = round(1000 * one_s["wall_s"] / one_s["completion_tokens"], 3)
    out["ms_per_token_two_ranks"] = round(1000 * two_s["wall_s"] / two_s["completion_tokens"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["replicas", "sharded", "all"], default="all")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scaling.json")
    parser.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_rank:
        probe_rank()
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    home = Path(os.environ.get("MLXD_HOME", Path.home() / ".cache" / "mlxd"))
    results: dict[str, Any] = {"note": "one 2-core machine, loopback only; ranks and "
                                       "replicas share its cores"}
    with tempfile.TemporaryDirectory(prefix="mlxd-scaling-") as tmp:
        logs = Path(tmp)
        if args.part in ("replicas", "all"):
            results["replicas"] = run_replicas(home, logs, args)
            print(json.dumps(results["replicas"], indent=2), flush=True)
        if args.part in ("sharded", "all"):
            results["sharded"] = run_sharded(home, logs, args)
            print(json.dumps(results["sharded"], indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
