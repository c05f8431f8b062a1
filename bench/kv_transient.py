"""Where a text model's memory goes in a prefill chunk and a decode step, beyond the live KV
that admission counts (docs/memory.md, "What the budget counts").

``python -m bench.kv_transient [--rows 3] [--prompt-tokens 1500] [--max-tokens 24]``: one
process, no server (preload OpenBLAS with ``LD_PRELOAD`` as ``bench/kv.py``: about a
minute then; without it, many). SmolLM2-135M float32 (as ``bench/kv_memory.py``) through mlxd's batched
decoder with the CPU prefill path installed, the way the engine runs it, and a prefix cache
of ``--prefix-cache-mib`` that every prompt's state is inserted into when its prefill ends
and when it finishes (as the scheduler does). Two phases: ``together``, ``--rows`` prompts
inserted at once (prefilled in one batch, padded to the longest); ``join``, the same
prompts but the last inserted while the others decode (its state joins the running
batch). Before each step MLX's peak and the process's peak RSS (``VmHWM``) are reset;
after it the step is recorded: its kind, the live KV the ledger counts (tokens held x
bytes per token), the batch buffer's bytes (``cache_nbytes``: rounded to 256 tokens,
rows padded to the longest), MLX's active, peak and cached bytes, and RSS. Reported per
step kind: the most each held beyond the model's weights and the live KV.

``--cache-limit-mib`` sets ``mx.set_cache_limit`` first; ``--mmap-threshold-kib`` sets
glibc's ``M_MMAP_THRESHOLD`` (fixed: large buffers are mapped and unmapped, never kept in
the heap). Results: ``bench/results/kv_transient.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
from pathlib import Path
from typing import Any

from bench.servers import write_report

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
M_MMAP_THRESHOLD = -3


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [100 + (seed * 7919 + k * 7) % (vocab - 200) for k in range(n)]


class Probe:
    """Steps a decoder and records what each step held."""

    def __init__(self, decoder: Any, prefix: Any, bytes_per_token: int, weights: int) -> None:
        self.decoder, self.prefix = decoder, prefix
        self.bpt, self.weights = bytes_per_token, weights
        self.held: dict[int, int] = {}  # uid -> tokens in its KV
        self.pending: dict[int, int] = {}  # uid -> prompt tokens not prefilled yet
        self.inserts: list[tuple[list[int], list[Any]]] = []
        self.steps: list[dict[str, Any]] = []

    def insert(self, tokens: list[int], max_tokens: int) -> int:
        from types import SimpleNamespace

        from mlxd.engines.text.sampling import greedy

        uid = self.decoder.insert(SimpleNamespace(tokens=tokens), 0, None, greedy, [], set(),
                                  max_tokens)
        self.held[uid], self.pending[uid] = 0, len(tokens)
        return int(uid)

    def step(self, phase: str) -> list[int]:
        import mlx.core as mx

        gc.collect()
        _reset_hwm()
        mx.reset_peak_memory()
        active0, rss0 = mx.get_active_memory(), _status("VmRSS")
        for tokens, cache in self.inserts:  # the scheduler inserts before its next step
            self.prefix.insert(tokens, cache)
        self.inserts = []
        prompts, responses = self.decoder.next()
        ended = []
        for p in prompts:
            if p.uid in self.pending:
                done = p.progress[0] if hasattr(p, "progress") else self.pending[p.uid]
                self.held[p.uid] = int(done)
            if p.end_of_prompt and p.uid in self.pending:
                self.pending.pop(p.uid)
                ended.append(p.uid)
        finished = []
        for r in responses:
            self.held[r.uid] = self.held.get(r.uid, 0) + 1
            if r.finish_reason is not None:
                finished.append(r.uid)
                if r.prompt_cache:
                    self.inserts.append((list(r.all_tokens), r.prompt_cache))
        if ended:  # in-flight caching of a prompt whose prefill ended
            for cache, toks in self.decoder.extract_cache(ended).values():
                self.inserts.append((list(toks), cache))
        live = sum(self.held.values()) * self.bpt
        kind = ("join" if ended else "prefill" if prompts and not responses else
                "prefill+decode" if prompts else "finish" if finished else "decode")
        row = {"phase": phase, "kind": kind, "rows": len(self.held),
               "live_kv": live, "batch_buffer": self.decoder.cache_nbytes(),
               "active_before": active0, "active": mx.get_active_memory(),
               "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory(),
               "rss_before": rss0, "rss": _status("VmRSS"), "hwm": _status("VmHWM"),
               "prefix_cache": self.prefix.nbytes}
        for uid in finished:
            self.held.pop(uid, None)
        self.steps.append(row)
        if row["kind"] != "decode" or len(self.steps) % 8 == 0:
            print(json.dumps({k: v // MIB if isinstance(v, int) and k != "rows" else v
                              for k, v in row.items()}), flush=True)
        return finished


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load

    from bench.model import smollm2_float32
    from mlxd.engines.device import release_free_memory, weights_nbytes
    from mlxd.engines.kernels.prefill import cpu_prefill_chunk, install_cpu_prefill_attention
    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
    from mlxd.engines.text.prefix_cache import PrefixCache
    from mlxd.models.memory import kv_bytes_per_token

    if args.cache_limit_mib is not None:
        mx.set_cache_limit(args.cache_limit_mib * MIB)
    if args.mmap_threshold_kib is not None:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, args.mmap_threshold_kib * 1024)
    folder = args.model or smollm2_float32(args.home)
    model = load(str(folder))[0]
    install_cpu_prefill_attention(model, True)
    config = json.loads((folder / "config.json").read_text())
    bpt = kv_bytes_per_token(config, 4)
    weights = weights_nbytes(model)
    vocab = int(config.get("vocab_size") or 32000)
    chunk = cpu_prefill_chunk(2048)
    sizes = [args.prompt_tokens + 83 * i for i in range(args.rows)]
    results: dict[str, Any] = {"model": folder.name, "weights": weights,
                               "bytes_per_token": bpt, "prefill_chunk": chunk,
                               "sizes": sizes, "max_tokens": args.max_tokens,
                               "cache_limit_mib": args.cache_limit_mib,
                               "mmap_threshold_kib": args.mmap_threshold_kib,
                               "default_cache_limit": None}
    for phase in ("together", "join"):
        decoder = LMBatchDecoder(model, eos_ids=[], max_num_seqs=16, prefill_step_size=chunk)
        prefix = PrefixCache(args.prefix_cache_mib * MIB)
        probe = Probe(decoder, prefix, bpt, weights)
        probe.insert(_prompt(99, 64, vocab), 2)  # warm up (kernels, BLAS threads)
        while probe.held:
            probe.step("warm")
        probe.steps.clear()
        probe.inserts.clear()
        prefix.clear()
        release_free_memory()
        results.setdefault("idle_rss", _status("VmRSS"))
        results.setdefault("idle_active", mx.get_active_memory())
        late = sizes[-1] if phase == "join" else None
        for i, n in enumerate(sizes if late is None else sizes[:-1]):
            probe.insert(_prompt(i + (10 if phase == "join" else 0), n, vocab), args.max_tokens)
        decoding = 0
        while probe.held:
            probe.step(phase)
            if probe.steps[-1]["kind"] in ("decode", "finish"):
                decoding += 1
            if late is not None and decoding >= 4:
                probe.insert(_prompt(len(sizes) + 10, late, vocab), args.max_tokens)
                late = None
        results[phase] = probe.steps
        decoder.close()
        del decoder, probe
        prefix.clear()
        gc.collect()
        release_free_memory()
    results["summary"] = summarize(results)
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase and step kind: the most MLX and RSS held beyond the weights and live KV."""
    out = []
    w = results["weights"]
    for phase in ("together", "join"):
        kinds: dict[str, list[dict[str, Any]]] = {}
        for s in results[phase]:
            kinds.setdefault(s["kind"], []).append(s)
        for kind, steps in kinds.items():
            def most(f: Any, rows: list[dict[str, Any]] = steps) -> int:
                return int(max(f(s) for s in rows))
            out.append({
                "phase": phase, "kind": kind, "steps": len(steps),
                "max_live_kv": most(lambda s: s["live_kv"]),
                "buffer_over_live": most(lambda s: s["batch_buffer"] - s["live_kv"]),
                "step_peak_over_active_before": most(lambda s: s["peak"] - s["active_before"]),
                "peak_over_weights_live_prefix": most(
                    lambda s: s["peak"] - w - s["live_kv"] - s["prefix_cache"]),
                "max_cache": most(lambda s: s["cache"]),
                "hwm_over_idle_live_prefix": most(
                    lambda s: s["hwm"] - results["idle_rss"] - s["live_kv"] - s["prefix_cache"]),
                "rss_over_idle_live_prefix": most(
                    lambda s: s["rss"] - results["idle_rss"] - s["live_kv"] - s["prefix_cache"]),
            })
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [f"## Memory beyond live KV, {results['model']}", "",
             f"Prompts {results['sizes']} tokens, {results['max_tokens']} output tokens each, "
             f"prefill chunk {results['prefill_chunk']}, {results['bytes_per_token']} bytes "
             f"of KV per token; weights {results['weights'] // MIB} MiB, idle RSS "
             f"{results['idle_rss'] // MIB} MiB; cache limit {results['cache_limit_mib']} MiB, "
             f"mmap threshold {results['mmap_threshold_kib']} KiB. MiB, the most over the "
             "steps of each kind: live KV; batch buffer - live KV; the step's MLX peak - "
             "MLX active before it; MLX peak - weights - live KV - prefix cache; MLX cache; "
             "peak RSS (and RSS after) - idle RSS - live KV - prefix cache.", "",
             "| phase | step | steps | live KV | buffer - live | step peak - before | "
             "peak - w - live - prefix | MLX cache | peak RSS over | RSS over |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        lines.append(
            f"| {r['phase']} | {r['kind']} | {r['steps']} | {r['max_live_kv'] // MIB} | "
            f"{r['buffer_over_live'] // MIB} | {r['step_peak_over_active_before'] // MIB} | "
            f"{r['peak_over_weights_live_prefix'] // MIB} | {r['max_cache'] // MIB} | "
            f"{r['hwm_over_idle_live_prefix'] // MIB} | {r['rss_over_idle_live_prefix'] // MIB} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.kv_transient", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prefix-cache-mib", type=int, default=128)
    p.add_argument("--cache-limit-mib", type=int, default=None)
    p.add_argument("--mmap-threshold-kib", type=int, default=None)
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="kv_transient")
    args = p.parse_args(argv)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, args.tag, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
