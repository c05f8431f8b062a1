"""``make bench`` / ``python -m bench.run [--quick]``: mlxd vs mlx_lm.server vs vllm-mlx vs raw
mlx-lm, in one run, on the same SmolLM2-135M float32 folder made by mlxd's converter.

Every contender runs as a subprocess on a free 127.0.0.1 port with the same
environment (the same BLAS: OpenBLAS preloaded when it is installed, see
``mlxd/blas.py``), gets the same workloads, and is killed at the end. Results go
to ``bench/results/<tag>.json`` and ``<tag>.md`` (tag ``latest``, or ``quick``
with ``--quick``); server logs to ``bench/results/logs/``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.model import smollm2_float32
from bench.servers import (
    ServerProcess,
    ServerSpec,
    free_port,
    machine,
    mlx_lm_spec,
    mlxd_spec,
    rss_bytes,
    subprocess_env,
    vllm_mlx_spec,
)
from mlxd.benchmark.loadgen import Target
from mlxd.benchmark.report import plot_levels, write_json

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ("mlxd", "mlx_lm.server", "vllm-mlx")


@dataclass(frozen=True)
class Sizes:
    """How big each workload is (full run vs ``--quick``)."""

    levels: tuple[int, ...] = (1, 8, 16)
    requests_per_stream: int = 2
    min_requests: int = 3
    prompt_tokens: int = 128
    max_tokens: int = 64
    level_seconds: float = 300.0
    prefix_tokens: int = 1500
    prefix_repeats: int = 3
    turns: int = 5
    itl_streams: int = 8
    itl_tokens: int = 128
    long_tokens: int = 2000
    soak_streams: int = 64
    soak_seconds: float = 120.0
    soak_tokens: int = 32

    def requests(self, concurrency: int) -> int:
        return max(self.requests_per_stream * concurrency, self.min_requests)


FULL = Sizes()
QUICK = Sizes(levels=(1, 8), requests_per_stream=1, min_requests=2, max_tokens=32,
              level_seconds=120.0, prefix_repeats=1, turns=3, itl_tokens=48, soak_seconds=15.0,
              soak_tokens=16)


def run_raw(folder: Path, sizes: Sizes, env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    """``python -m bench.raw`` in its own process (same env as the servers)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.json"
        cmd = [sys.executable, "-m", "bench.raw", str(folder),
               "--batches", ",".join(map(str, sizes.levels)),
               "--prompt-tokens", str(sizes.prompt_tokens), "--max-tokens", str(sizes.max_tokens),
               "--json", str(out)]
        with (log_dir / "raw.log").open("wb") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=1800, check=False)
        if proc.returncode != 0:
            return {"error": f"bench.raw exited with {proc.returncode} (see logs/raw.log)"}
        return dict(json.loads(out.read_text()))


def run_prefill(folder: Path, sizes: Sizes, env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    """``python -m bench.prefill``: cold prefill of ``long_tokens``, mlxd vs before (own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "prefill.json"
        cmd = [sys.executable, "-m", "bench.prefill", "--folder", str(folder),
               "--tokens", str(sizes.long_tokens), "--json", str(out)]
        with (log_dir / "prefill.log").open("wb") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=3600, check=False)
        if proc.returncode != 0:
            return {"error": f"bench.prefill exited with {proc.returncode} (see logs/prefill.log)"}
        return dict(json.loads(out.read_text()))


async def _guarded(coro: Any) -> Any:
    """A scenario's result, or ``{"error": ...}`` so one failure does not end the run."""
    try:
        return await coro
    except Exception as e:  # the run goes on; the report shows what failed
        return {"error": f"{type(e).__name__}: {e}"}


async def server_scenarios(target: Target, srv: ServerProcess, sizes: Sizes,
                           soak: bool) -> dict[str, Any]:
    """Every workload against one running server, in order."""
    from bench import scenarios

    out: dict[str, Any] = {"rss_loaded_mb": round(rss_bytes(srv.pid) / 2**20, 1),
                           "started_in_s": round(srv.started_in_s, 1)}
    out["throughput"] = await scenarios.throughput(
        target, list(sizes.levels), sizes.requests, sizes.prompt_tokens, sizes.max_tokens,
        sizes.level_seconds)
    out["prefix_ttft"] = await _guarded(scenarios.prefix_ttft(
        target, sizes.prefix_tokens, sizes.prefix_repeats))
    out["conversation"] = await _guarded(scenarios.conversation(
        target, sizes.turns, 256, sizes.max_tokens))
    out["itl_long_prompt"] = await _guarded(scenarios.itl_under_long_prompt(
        target, sizes.itl_streams, sizes.itl_tokens, sizes.long_tokens))
    if soak:
        out["soak"] = await _guarded(scenarios.soak(
            target, lambda: rss_bytes(srv.pid), sizes.soak_streams, sizes.soak_seconds,
            sizes.soak_tokens))
    return out


def server_spec(name: str, folder: Path, port: int, home: Path, blas: str) -> ServerSpec:
    if name == "mlxd":
        return mlxd_spec(folder, port, home, blas)
    if name == "mlx_lm.server":
        return mlx_lm_spec(folder, port)
    from bench.peers import ensure_vllm_mlx

    return vllm_mlx_spec(ensure_vllm_mlx(), folder, port)


def run_server(name: str, folder: Path, args: argparse.Namespace, sizes: Sizes,
               env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    """Start one contender, run every workload, always stop it."""
    print(f"--- {name}", flush=True)
    port = free_port()
    try:
        spec = server_spec(name, folder, port, args.home, "off" if args.blas == "off" else "auto")
        with ServerProcess(spec, port, env, log_dir / f"{name}.log") as srv:
            target = Target(url=srv.url, model=spec.model)
            soak = name == "mlxd" or args.soak_all
            return asyncio.run(server_scenarios(target, srv, sizes, soak and not args.no_soak))
    except Exception as e:  # a contender that cannot start is reported, the others still run
        return {"error": f"{type(e).__name__}: {e}"}


def run_embeddings(quick: bool) -> dict[str, Any]:
    """``bench/embeddings.py`` (another benchmark) when it exists: ``main(argv) -> int``."""
    try:
        from bench import embeddings  # type: ignore[attr-defined]
    except ImportError:
        return {"skipped": "bench/embeddings.py is not there"}
    return {"exit_code": embeddings.main(["--quick"] if quick else [])}


def run_agent_trace(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/agent_trace.py`` (its own results: ``agent_trace.md``); shorter with --quick."""
    from bench import agent_trace

    servers = args.servers
    if args.agent_trace_kv_bits and "mlxd" in servers.split(","):  # mlxd with --kv-bits beside
        servers += f",mlxd-kv{args.agent_trace_kv_bits}"
    argv = ["--servers", servers, "--home", str(args.home), "--out", str(args.out)]
    if args.quick:
        argv += ["--turns", "4", "--max-tokens", "64", "--tag", "agent_trace_quick"]
    return {"exit_code": agent_trace.main(argv)}


def run_vision(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/vision.py`` (its own results: ``vision.md``); a small model with --quick."""
    from bench import vision

    argv = ["--home", str(args.home), "--out", str(args.out)]
    return {"exit_code": vision.main([*argv, "--quick"] if args.quick else argv)}


def run_audio_tts(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/audio_tts.py``: TTS x realtime and time to first audio (``audio-tts.md``)."""
    from bench import audio_tts

    argv = ["--home", str(args.home), "--out", str(args.out), "--blas", args.blas]
    return {"exit_code": audio_tts.main([*argv, "--quick"] if args.quick else argv)}


def run_audio_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/audio_concurrency.py``: STT uploads and TTS requests at once vs one at a time,
    and time to first audio (``audio-concurrency.md``)."""
    from bench import audio_concurrency

    argv = ["--home", str(args.home), "--out", str(args.out), "--blas", args.blas]
    return {"exit_code": audio_concurrency.main([*argv, "--quick"] if args.quick else argv)}


def run_audio_stt(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/audio.py``: STT on 60 s and 10 min, mlxd batched vs sequential vs raw
    mlx-whisper, with word error rates (``audio.md``)."""
    from bench import audio

    argv = ["--home", str(args.home), "--out", str(args.out), "--blas", args.blas]
    return {"exit_code": audio.main([*argv, "--quick"] if args.quick else argv)}


def run_speculative(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/speculative.py``: prompt lookup vs none, in-process (``speculative.md``);
    then ``bench/speculative_draft.py``: a draft model vs none (``speculative_draft.md``)."""
    from bench import speculative, speculative_draft

    argv = ["--home", str(args.home), "--out", str(args.out)]
    argv = [*argv, "--quick"] if args.quick else argv
    return {"exit_code": speculative.main(argv),
            "draft_exit_code": speculative_draft.main(argv)}


def run_lora(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/lora.py``: 4 LoRA adapters over one base vs the base alone vs 4 fused models,
    each an ``mlxd serve`` under one memory budget (``lora.md``)."""
    from bench import lora

    argv = ["--home", str(args.home), "--out", str(args.out), "--blas", args.blas]
    return {"exit_code": lora.main([*argv, "--quick"] if args.quick else argv)}


def run_kv(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/kv.py``: quantized KV against full precision, in-process (``kv.md``)."""
    from bench import kv

    argv = ["--home", str(args.home), "--out", str(args.out)]
    return {"exit_code": kv.main([*argv, "--quick"] if args.quick else argv)}


def run_kv_memory(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/kv_memory.py``: the prefix cache's disk tier (TTFT cold / RAM hit / read back
    from disk) and admission by live KV under a small budget, each an ``mlxd serve``
    (``kv_memory.md``)."""
    from bench import kv_memory

    argv = ["--home", str(args.home), "--out", str(args.out), "--blas", args.blas]
    return {"exit_code": kv_memory.main([*argv, "--quick"] if args.quick else argv)}


def plot_series(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Throughput levels per contender, the raw BatchGenerator as one more line."""
    series = {n: s.get("throughput", []) for n, s in results["servers"].items()
              if not s.get("error")}
    raw = (results.get("raw") or {}).get("batch_generate", [])
    if raw:
        series["raw BatchGenerator"] = [{"concurrency": r["batch"],
                                         "aggregate_tok_s": r["e2e_tok_s"],
                                         "ttft_s": {"p50": None}} for r in raw]
    return series


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short version (a few minutes)")
    p.add_argument("--servers", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--no-raw", action="store_true", help="skip the raw mlx-lm ceiling")
    p.add_argument("--no-soak", action="store_true", help="skip the 64-stream soak")
    p.add_argument("--no-prefill", action="store_true", help="skip the cold prefill bench")
    p.add_argument("--soak-all", action="store_true", help="soak the peers too (default mlxd)")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto",
                   help="BLAS for every contender (default: OpenBLAS when installed)")
    p.add_argument("--embeddings", action="store_true", help="also run bench/embeddings.py")
    p.add_argument("--no-agent-trace", action="store_true",
                   help="skip the agent trace (bench/agent_trace.py)")
    p.add_argument("--agent-trace-kv-bits", type=int, choices=(0, 4, 8), default=8,
                   help="the agent trace also runs mlxd with --kv-bits N (row mlxd-kvN); "
                        "0: not")
    p.add_argument("--no-vision", action="store_true",
                   help="skip the vision benchmark (bench/vision.py)")
    p.add_argument("--no-speculative", action="store_true",
                   help="skip the speculative decoding benchmarks (bench/speculative.py, "
                        "bench/speculative_draft.py)")
    p.add_argument("--no-lora", action="store_true",
                   help="skip the LoRA adapters benchmark (bench/lora.py)")
    p.add_argument("--no-kv", action="store_true",
                   help="skip the quantized KV benchmark (bench/kv.py)")
    p.add_argument("--no-kv-memory", action="store_true",
                   help="skip the KV disk tier and admission benchmark (bench/kv_memory.py)")
    p.add_argument("--no-tts", action="store_true",
                   help="skip the text-to-speech benchmark (bench/audio_tts.py)")
    p.add_argument("--no-stt", action="store_true",
                   help="skip the speech-to-text benchmark (bench/audio.py)")
    p.add_argument("--no-audio-concurrency", action="store_true",
                   help="skip the concurrent speech benchmark (bench/audio_concurrency.py)")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default=None, help="result file names (default latest / quick)")
    p.add_argument("--plot", action="store_true", help="also write <tag>.png")
    args = p.parse_args(argv)
    unknown = set(args.servers.split(",")) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contenders: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.summary import markdown

    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    tag = args.tag or ("quick" if args.quick else "latest")
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    folder = smollm2_float32(args.home)
    env, blas = subprocess_env(args.blas)
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "environment": {**machine(blas, ("mlx", "mlx-lm", "mlxd")), "model": folder.name},
        "sizes": asdict(sizes),
        "workload": f"{sizes.prompt_tokens}-token prompts, {sizes.max_tokens} output tokens, "
                    "temperature 0, streamed", "servers": {}}
    print(f"model {folder}\nBLAS: {blas}", flush=True)
    if not args.no_raw:
        print("--- raw mlx-lm", flush=True)
        results["raw"] = run_raw(folder, sizes, env, log_dir)
    for name in args.servers.split(","):
        results["servers"][name] = run_server(name, folder, args, sizes, env, log_dir)
    if not args.no_prefill:
        print("--- cold prefill", flush=True)
        results["prefill"] = run_prefill(folder, sizes, env, log_dir)
    if args.embeddings:
        results["embeddings"] = run_embeddings(args.quick)
    if not args.no_agent_trace:
        results["agent_trace"] = run_agent_trace(args)
    if not args.no_vision:
        results["vision"] = run_vision(args)
    if not args.no_speculative:
        results["speculative"] = run_speculative(args)
    if not args.no_lora:
        results["lora"] = run_lora(args)
    if not args.no_kv:
        results["kv"] = run_kv(args)
    if not args.no_kv_memory:
        results["kv_memory"] = run_kv_memory(args)
    if not args.no_tts:
        results["audio_tts"] = run_audio_tts(args)
    if not args.no_stt:
        results["audio_stt"] = run_audio_stt(args)
    if not args.no_audio_concurrency:
        results["audio_concurrency"] = run_audio_concurrency(args)
    write_json(args.out / f"{tag}.json", results)
    report = markdown(results)
    if "seconds" in results.get("prefill", {}):
        from bench.prefill import markdown as prefill_markdown

        report += "\n" + prefill_markdown(results["prefill"])
    (args.out / f"{tag}.md").write_text(report)
    if args.plot:
        plot_levels(args.out / f"{tag}.png", plot_series(results))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
