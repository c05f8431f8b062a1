"""``python -m bench.agent_trace`` (part of ``make bench``): the agent trace against mlxd,
mlx_lm.server and vllm-mlx, same model folders, same run.

Models: SmolLM2-135M float32 (the starter model, through mlxd's converter) and a
hybrid model of realistic shape with random weights (``qwen3_next``: gated
delta-net layers with one attention layer in four, ~120M parameters, SmolLM2's
tokenizer and chat template). mlxd and vllm-mlx get the turns over
``/v1/messages``, mlx_lm.server over ``/v1/chat/completions``; all three with the
tools described in the system message (SmolLM2's template drops ``tools``), so every
server sees the same prompt; the prompt token counts the servers report are in the
per-turn tables (vllm-mlx reports none when streaming). Results: ``bench/results/agent_trace.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.model import smollm2_float32
from bench.servers import ServerProcess, free_port, machine, subprocess_env
from mlxd.benchmark.agent_trace import TraceSpec, build_trace
from mlxd.benchmark.report import write_json
from mlxd.benchmark.trace_io import TraceApi, TraceRequest, agent_requests
from mlxd.benchmark.trace_replay import TraceTarget, replay, warm_up
from mlxd.benchmark.trace_report import comparison, markdown, summarize

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("mlxd", "mlx_lm.server", "vllm-mlx")
# Opt-in extra rows (``--servers mlxd,mlxd-lookup,...``): mlxd with prompt-lookup
# speculation forced on (``--speculative auto`` leaves it off on a CPU without a fast
# BLAS), mlxd with it off, and mlxd with its KV quantized to 8 or 4 bits (``--kv-bits``;
# the hybrid's attention layers, its recurrent state as it is), 8 bits also without
# speculation (beside ``mlxd-plain``: decode speed apart from prompt lookup's hits).
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "mlxd-lookup": ("--speculative", "prompt-lookup"),
    "mlxd-plain": ("--speculative", "off"),
    "mlxd-kv8": ("--kv-bits", "8"),
    "mlxd-kv4": ("--kv-bits", "4"),
    "mlxd-kv8-plain": ("--kv-bits", "8", "--speculative", "off")}
VARIANTS = tuple(VARIANT_FLAGS)
MODELS = ("smollm2", "hybrid")
# How each server is sent the turns: (API, tools described in the system message).
# SmolLM2's chat template (also the hybrid's) cannot render tools: mlx_lm.server and
# vllm-mlx would drop them silently and mlxd would describe them its own way, so every
# server gets the same description in the system message.
APIS: dict[str, tuple[TraceApi, bool]] = {"mlxd": ("messages", True),
                                          "mlxd-lookup": ("messages", True),
                                          "mlxd-plain": ("messages", True),
                                          "mlxd-kv8": ("messages", True),
                                          "mlxd-kv4": ("messages", True),
                                          "mlxd-kv8-plain": ("messages", True),
                                          "mlx_lm.server": ("chat", True),
                                          "vllm-mlx": ("messages", True)}
HYBRID_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_next", "hidden_size": 768, "num_hidden_layers": 12,
    "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "linear_num_value_heads": 16, "linear_num_key_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 0, "mlp_only_layers": [], "moe_intermediate_size": 0,
    "rms_norm_eps": 1e-6, "vocab_size": 49152, "rope_theta": 100000.0,
    "partial_rotary_factor": 0.25, "max_position_embeddings": 32768,
    "full_attention_interval": 4, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def hybrid_model(home: Path, smollm2: Path) -> Path:
    """A random-weight ``qwen3_next`` folder (built once, seed 0) with SmolLM2's tokenizer."""
    folder = home / "bench-models" / "qwen3-next-hybrid-120m-random"
    if (folder / "model.safetensors").exists():
        return folder
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    mx.random.seed(0)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(HYBRID_CONFIG))
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(HYBRID_CONFIG, indent=2))
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, tmp / name)
    tmp.rename(folder)
    return folder


def spec_for(name: str, folder: Path, port: int, home: Path) -> Any:
    from bench.servers import mlx_lm_spec, mlxd_spec, vllm_mlx_spec

    if name == "mlxd" or name in VARIANT_FLAGS:  # starts cold like the peers: no persisted cache
        spec = mlxd_spec(folder, port, home, "auto")
        extra = VARIANT_FLAGS.get(name, ())
        return dataclasses.replace(spec, argv=(*spec.argv, "--no-prefix-cache-persist", *extra))
    if name == "mlx_lm.server":
        return mlx_lm_spec(folder, port)
    from bench.peers import ensure_vllm_mlx

    return vllm_mlx_spec(ensure_vllm_mlx(), folder, port)


async def _runs(target: TraceTarget, runs: list[list[list[TraceRequest]]],
                timeout: float) -> dict[int, dict[str, Any]]:
    warm = await warm_up(target, timeout)
    if not warm.ok:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    out = {}
    for sessions in runs:
        print(f"    {len(sessions)} session(s) ...", flush=True)
        out[len(sessions)] = summarize(await replay(target, sessions, timeout))
    return out


def run_server(name: str, folder: Path, runs: list[list[list[TraceRequest]]],
               args: argparse.Namespace, env: dict[str, str], tag: str) -> dict[int, Any]:
    """Start one server on ``folder``, replay every run, always stop it."""
    print(f"--- {name} on {folder.name}", flush=True)
    port = free_port()
    api, tools_in_system = APIS[name]
    try:
        spec = spec_for(name, folder, port, args.home)
        log = args.out / "logs" / f"agent-{tag}-{name}.log"
        with ServerProcess(spec, port, env, log) as srv:
            target = TraceTarget(url=srv.url, model=spec.model, api=api,
                                 tools_in_system=tools_in_system)
            return asyncio.run(_runs(target, runs, args.timeout))
    except Exception as e:  # a server that fails is reported; the others still run
        return {0: {"error": f"{type(e).__name__}: {e}"}}


def session_runs(args: argparse.Namespace) -> tuple[list[list[list[TraceRequest]]], Any]:
    """For each ``--sessions`` value N, N new sessions of the trace (none sent twice)."""
    small = {"tools": 3, "system_sections": 2, "max_file_chars": 1500} if args.small else {}
    spec = TraceSpec(sessions=sum(args.sessions), turns=args.turns, max_tokens=args.max_tokens,
                     **small)  # type: ignore[arg-type]
    trace = build_trace(spec)
    pool = agent_requests(trace, "model")
    runs, start = [], 0
    for n in args.sessions:
        runs.append(pool[start:start + n])
        start += n
    return runs, trace


def report(results: dict[str, Any]) -> str:
    """The markdown of a run: the comparison per model, then per-turn tables."""
    lines = ["# Agent trace: mlxd vs mlx_lm.server vs vllm-mlx", "",
             f"Run {results['started_at']} on {results['environment']['cpu']} "
             f"({results['environment']['cores']} cores; shared with other jobs, so compare "
             "ratios within this run only). Trace: " + results["trace"]["about"], ""]
    for model, per_server in results["models"].items():
        ok = {s: r for s, r in per_server.items() if "0" not in r and 0 not in r}
        lines += [f"## {model}", "", "Session wall time (mean over the sessions run together); "
                  "`x vs mlxd` = that server's time / mlxd's (>1: mlxd is faster).", "",
                  comparison(ok, "mlxd"), ""]
        for server, r in per_server.items():
            err = r.get(0) or r.get("0")
            if err:
                lines += [f"### {server}: failed: {err['error']}", ""]
                continue
            lines += [markdown(summary, server) for summary in r.values()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.agent_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--sessions", default="1,4", help="sessions side by side per run")
    p.add_argument("--turns", type=int, default=8, help="turns per session (6-10 realistic)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer budget per turn")
    p.add_argument("--small", action="store_true",
                   help="a smoke test: 3 tools, 2 system sections, files cut at 1,500 "
                        "characters (not the agent trace's sizes)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--home", type=Path, default=default_home())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="agent_trace", help="result file names")
    args = p.parse_args(argv)
    args.sessions = [int(v) for v in args.sessions.split(",") if v.strip()]
    for key, allowed in (("servers", SERVERS + VARIANTS), ("models", MODELS)):
        chosen = getattr(args, key).split(",")
        if set(chosen) - set(allowed):
            p.error(f"--{key}: choose from {', '.join(allowed)}")
        setattr(args, key, chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    env, blas = subprocess_env("auto")
    smollm2 = smollm2_float32(args.home)
    folders = {"smollm2": smollm2}
    if "hybrid" in args.models:
        folders["hybrid"] = hybrid_model(args.home, smollm2)
    runs, trace = session_runs(args)
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "environment": machine(blas, ("mlx", "mlx-lm", "mlxd")),
        "trace": {"digest": trace.digest(), "python": trace.python, "sources": trace.sources,
                  "about": f"{'SMALL smoke-test trace, ' if args.small else ''}"
                           f"{args.turns} turns per session, sessions {args.sessions} side by "
                           f"side, max_tokens {args.max_tokens}, greedy; sha256 "
                           f"{trace.digest()[:16]} (Python {trace.python})"},
        "models": {}}
    for model in args.models:
        results["models"][model] = {
            name: run_server(name, folders[model], runs, args, env, model)
            for name in args.servers}
    write_json(args.out / f"{args.tag}.json", results)
    text = report(results)
    (args.out / f"{args.tag}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
