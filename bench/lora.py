"""LoRA adapters over one base vs the base alone vs the adapters fused into 4 models.

``python -m bench.lora [--quick]``: three ``mlxd serve`` processes, one after the
other, each under the same ``--memory-budget``, get the same greedy load: N
requests at concurrency C (default 8 and 8), each ``--max-tokens`` long.

- ``base``: every request to SmolLM2-135M float32 alone.
- ``adapters``: the base served with 4 LoRA adapters (``--adapter``), the requests
  spread round-robin over the 4 adapter names: rows of one batch, each with its own
  adapter (``engines/text/lora.py``).
- ``fused``: the 4 adapters fused into 4 models by mlx-lm's own ``mlx_lm.fuse``, served
  from a registry file, the requests spread over them: each model batches only its
  own requests, and the budget decides how many stay loaded.

The adapters are rank-8 LoRA on q/v of the last 16 layers in mlx-lm's format, with
seeded random factors: speed and memory do not depend on what an adapter learnt.
Reported per setup: aggregate completion tok/s (timed after one warm-up request per
name), the ratio to ``base``, the server's peak RSS, and the bytes the server
accounts to its models (``/v1/models``). Results: ``bench/results/lora.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import (
    ServerProcess,
    ServerSpec,
    free_port,
    rss_bytes,
    subprocess_env,
    write_report,
)

REPO = Path(__file__).resolve().parent.parent
ADAPTERS = 4
PROMPT = "Write a short story about a lighthouse keeper and a storm."


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8, layers: int = 16) -> Path:
    """A rank-``rank`` LoRA adapter of ``base`` (q/v of its last ``layers`` layers) in
    mlx-lm's format, with seeded random factors."""
    import mlx.core as mx

    config = json.loads((base / "config.json").read_text())
    n, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    dims = {"q_proj": hidden, "v_proj": hidden // heads * kv_heads}
    mx.random.seed(seed)
    weights = {}
    for i in range(n - layers, n):
        for key, out_dims in dims.items():
            path = f"model.layers.{i}.self_attn.{key}"
            weights[f"{path}.lora_a"] = mx.random.normal((hidden, rank)) * hidden ** -0.5
            weights[f"{path}.lora_b"] = mx.random.normal((rank, out_dims)) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": layers,
        "lora_parameters": {"rank": rank, "scale": 20.0, "dropout": 0.0,
                            "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}))
    return out


def fuse(base: Path, adapter: Path, out: Path, env: dict[str, str]) -> Path:
    """mlx-lm's own ``mlx_lm.fuse``: the adapter merged into a copy of the base."""
    subprocess.run([sys.executable, "-m", "mlx_lm.fuse", "--model", str(base),
                    "--adapter-path", str(adapter), "--save-path", str(out)],
                   env=env, check=True, capture_output=True, timeout=900)
    return out


def serve_argv(port: int, home: Path, budget: str, blas: str) -> list[str]:
    return [sys.executable, "-m", "mlxd", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--no-starter", "--home", str(home), "--log-level", "warning", "--blas", blas,
            "--memory-budget", budget, "--no-prefix-cache-persist"]


class PeakRSS:
    """The server's peak resident memory, sampled every 0.2 s on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _one(client: httpx.AsyncClient, model: str, max_tokens: int) -> int:
    r = await client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def drive(url: str, names: list[str], requests: int, concurrency: int,
                max_tokens: int) -> dict[str, Any]:
    """One warm-up request per name, then ``requests`` spread round-robin over ``names``,
    ``concurrency`` at a time: aggregate completion tok/s."""
    async with httpx.AsyncClient(base_url=url, timeout=1800, trust_env=False) as client:
        for name in names:
            await _one(client, name, 2)
        gate = asyncio.Semaphore(concurrency)

        async def limited(i: int) -> int:
            async with gate:
                return await _one(client, names[i % len(names)], max_tokens)

        start = time.monotonic()
        tokens = sum(await asyncio.gather(*(limited(i) for i in range(requests))))
        seconds = time.monotonic() - start
        models = (await client.get("/v1/models")).json()["data"]
    held = sum(int(m.get("memory_bytes") or 0) for m in models
               if not m.get("adapter") and m.get("state") == "loaded")
    return {"tokens": tokens, "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 2) if seconds else 0.0, "model_bytes": held,
            "loaded": [m["id"] for m in models if m.get("state") == "loaded"
                       and not m.get("adapter")]}


def run_setup(name: str, argv: list[str], port: int, names: list[str], args: argparse.Namespace,
              env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    spec = ServerSpec(name, tuple(argv), names[0])
    with ServerProcess(spec, port, env, log_dir / f"lora-{name}.log") as srv, \
            PeakRSS(srv.pid) as rss:
        row = asyncio.run(drive(srv.url, names, args.requests, args.concurrency,
                                args.max_tokens))
    row.update(setup=name, names=len(names), peak_rss=rss.peak)
    print(json.dumps(row), flush=True)
    return row


def run(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    env, blas = subprocess_env(args.blas)
    log_dir = args.out / "logs"
    results: dict[str, Any] = {"model": base.name, "blas": blas, "budget": args.memory_budget,
                               "requests": args.requests, "concurrency": args.concurrency,
                               "max_tokens": args.max_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = [make_adapter(base, root / f"adapter{i}", seed=i) for i in range(ADAPTERS)]
        fused = [fuse(base, a, root / f"fused{i}", env) for i, a in enumerate(adapters)]
        registry = root / "fused.yaml"
        registry.write_text("models:\n" + "".join(
            f"  - name: fused{i}\n    source: {f}\n" for i, f in enumerate(fused)))
        port = free_port()
        common = serve_argv(port, args.home, args.memory_budget, args.blas)
        setups = [
            ("base", [*common, str(base), "--served-model-name", "base"], ["base"]),
            ("adapters", [*common, str(base), "--served-model-name", "base",
                          *(x for i, a in enumerate(adapters)
                            for x in ("--adapter", f"adapter{i}={a}"))],
             [f"adapter{i}" for i in range(ADAPTERS)]),
            ("fused", [*common, "--models-config", str(registry)],
             [f"fused{i}" for i in range(ADAPTERS)]),
        ]
        for name, argv, names in setups:
            results["rows"].append(run_setup(name, argv, port, names, args, env, log_dir))
    base_tok_s = results["rows"][0]["tok_s"] or 1.0
    for row in results["rows"]:
        row["vs_base"] = round(row["tok_s"] / base_tok_s, 2)
    return results


def markdown(results: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"## LoRA adapters: {results['requests']} requests at c{results['concurrency']}, "
             f"{results['max_tokens']} tokens each, budget {results['budget']}, "
             f"{results['model']} ({results['blas']})", "",
             "| setup | names | aggregate tok/s | vs base | peak RSS MiB | model bytes MiB | "
             "loaded at the end |", "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['setup']} | {r['names']} | {r['tok_s']} | {r['vs_base']}x | "
                     f"{r['peak_rss'] // mib} | {r['model_bytes'] // mib} | "
                     f"{', '.join(r['loaded'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 tokens a request")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (quick: 8)")
    p.add_argument("--memory-budget", default="3GB",
                   help="the same for every setup (SmolLM2 float32 is ~0.5 GB of weights)")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="lora", help="result file names")
    args = p.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 8 if args.quick else 128
    base = args.model or smollm2_float32(args.home)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, args.tag, run(base, args), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
