"""The prefix cache's disk tier and admission by live KV, each against a real ``mlxd serve``.

``python -m bench.kv_memory [--quick]`` (also run by ``make bench``; skip it with
``--no-kv-memory``). Two parts, on SmolLM2-135M float32 (as ``bench/kv.py``), each a
server on 127.0.0.1 with a home of its own (a temporary folder: a disk tier left by an
earlier run would make the cold prefills warm), streamed chat requests, greedy:

1. **Disk tier** (``--prefix-cache-disk-bytes``). The RAM prefix cache
   (``--prefix-cache-bytes``) holds one ~4k-token state, not two. Each repeat takes a
   new ~4k-token prefix A and sends, one after the other: A + ending 0 (**cold**: nothing
   cached); A + ending 1 (**RAM hit**); another cold ~4k-token prompt B, whose state
   evicts A's from RAM to the disk tier (the bench waits until ``/metrics`` shows the tier
   holding more bytes); A + ending 2 (**disk**: read back from the tier). Reported: the
   median TTFT of each state, the ratios, ``cached_tokens`` of each request, and
   ``mlxd_prefix_cache_disk_reads`` before and after each disk request (a disk row only
   counts when that counter rose and the RAM cache could not cover the prefix).
2. **Admission** (``--memory-budget``: weights + prefix cache + the model's transient
   reserve + KV for a few sequences), two servers:
   ``limited``: N long prompts (2-3k tokens, each different) at once, ``max_tokens``
   each (a grant holds prompt + output limit from the start, so the ones that do not
   fit wait in the queue); ``unlimited``: N/2 1k-token prompts with no ``max_tokens``
   under ``--kv-output-estimate 16`` and ``--max-context 1600`` (grants grow 256 tokens
   at a time while the answers run, so the newest sequences are preempted and resumed).
   The server's RSS (the process and its children, ``VmRSS``) is sampled every 50 ms and
   ``/metrics`` every 0.5 s. Reported: peak RSS against the budget and against the
   budget plus the stated margin (``--margin-mib``, 256: what the process may hold
   outside the budget, Python, the tokenizer, the HTTP stack and MLX's allocator; the
   idle RSS over the model's accounted bytes is printed next to it), met or not met, the
   status of every request
   (all 200, none lost), ``mlxd_kv_preemptions``, the most ``mlxd_kv_waiting_for_memory``
   seen, the peak live KV bytes and the allowance.

Results: ``bench/results/kv_memory.{json,md}``; server logs in ``bench/results/logs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import (
    SERVED_NAME,
    ServerProcess,
    ServerSpec,
    descendants,
    free_port,
    rss_bytes,
    subprocess_env,
    write_report,
)
from mlxd.benchmark.loadgen import (
    RequestResult,
    Target,
    Workload,
    make_client,
    request_body,
    stream_request,
)
from mlxd.benchmark.prompts import PromptSpec, first_messages

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def serve_argv(folder: Path, port: int, home: Path, blas: str, *extra: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "mlxd", "serve", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--no-starter",
            "--home", str(home), "--log-level", "warning", "--blas", blas,
            "--no-prefix-cache-persist", *extra)


def metrics(url: str) -> dict[str, float]:
    """Every ``mlxd_`` sample of the served model (and unlabelled ones), ``_total`` cut."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model", SERVED_NAME) == SERVED_NAME and not s.labels.keys() - {
                    "model"}:
                out[s.name.removesuffix("_total")] = s.value
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


# ---------------------------------------------------------------- disk tier


async def _send(client: httpx.AsyncClient, target: Target, spec: PromptSpec, index: int,
                max_tokens: int) -> RequestResult:
    body = request_body(target, Workload(spec=spec, max_tokens=max_tokens),
                        first_messages(spec, index))
    return await stream_request(client, target, body, index=index, timeout=900.0)


def _wait_disk_growth(url: str, before: float, limit_s: float = 120.0) -> float:
    """Wait until the disk tier holds more than ``before`` bytes and stops growing."""
    deadline = time.monotonic() + limit_s
    last = before
    while time.monotonic() < deadline:
        now = metrics(url).get("mlxd_prefix_cache_disk_bytes", 0.0)
        if now > before and now == last:
            return now
        last = now
        time.sleep(0.5)
    return last


def _row(kind: str, repeat: int, r: RequestResult, **extra: Any) -> dict[str, Any]:
    return {"state": kind, "repeat": repeat, "status": r.status, "error": r.error,
            "ttft_s": round(r.ttft, 3) if r.ttft else None, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, **extra}


def disk_tier(folder: Path, args: argparse.Namespace, env: dict[str, str],
              log_dir: Path) -> dict[str, Any]:
    from mlxd.models.memory import kv_bytes_per_token

    per_token = kv_bytes_per_token(json.loads((folder / "config.json").read_text()), 4)
    entry = per_token * (args.prefix_tokens + 200)
    ram = int(entry * 1.5)  # one ~4k-token state fits, two do not
    disk = entry * 12
    port = free_port()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as home:
        spec = ServerSpec("mlxd-disk", serve_argv(
            folder, port, Path(home), args.blas, "--prefix-cache-bytes", str(ram),
            "--prefix-cache-disk-bytes", str(disk)), SERVED_NAME)
        with ServerProcess(spec, port, env, log_dir / "kv_memory-disk.log") as srv:
            target = Target(url=srv.url, model=SERVED_NAME)
            asyncio.run(_warm(target))
            for i in range(args.repeats):
                rows += asyncio.run(_disk_repeat(target, args, i))
                print(json.dumps(rows[-4:]), flush=True)
    ok = [r for r in rows if r["status"] == 200 and not r["error"] and r["ttft_s"]]
    cold = [r["ttft_s"] for r in ok if r["state"] in ("cold", "cold (evicts)")]
    ram_hit = [r["ttft_s"] for r in ok if r["state"] == "ram"]
    from_disk = [r["ttft_s"] for r in ok if r["state"] == "disk" and r["disk_reads"] >= 1]
    c, m, d = _median(cold), _median(ram_hit), _median(from_disk)
    return {"prefix_tokens": args.prefix_tokens, "repeats": args.repeats,
            "prefix_cache_bytes": ram, "prefix_cache_disk_bytes": disk,
            "kv_bytes_per_token": per_token, "rows": rows,
            "cold_ttft_s": c, "ram_ttft_s": m, "disk_ttft_s": d,
            "cold_samples": len(cold), "disk_samples": len(from_disk),
            "cold_over_disk": round(c / d, 2) if c and d else None,
            "cold_over_ram": round(c / m, 2) if c and m else None,
            "disk_over_ram": round(d / m, 2) if d and m else None}


async def _warm(target: Target) -> None:
    async with make_client(2, 900.0) as client:
        await _send(client, target, PromptSpec(prompt_tokens=64, seed=1), 0, 4)


async def _disk_repeat(target: Target, args: argparse.Namespace, i: int) -> list[dict[str, Any]]:
    size = args.prefix_tokens + 100
    a = PromptSpec(prompt_tokens=size, shared_prefix_tokens=args.prefix_tokens,
                   seed=31000 + i)
    b = PromptSpec(prompt_tokens=size, shared_prefix_tokens=args.prefix_tokens,
                   seed=32000 + i)
    out = []
    async with make_client(2, 900.0) as client:
        out.append(_row("cold", i, await _send(client, target, a, 0, args.max_tokens)))
        out.append(_row("ram", i, await _send(client, target, a, 1, args.max_tokens)))
        before = metrics(target.url).get("mlxd_prefix_cache_disk_bytes", 0.0)
        out.append(_row("cold (evicts)", i, await _send(client, target, b, 0, args.max_tokens)))
        held = await asyncio.to_thread(_wait_disk_growth, target.url, before)
        m0 = metrics(target.url)
        r = await _send(client, target, a, 2, args.max_tokens)
        m1 = metrics(target.url)
        reads = m1.get("mlxd_prefix_cache_disk_reads", 0.0) - m0.get(
            "mlxd_prefix_cache_disk_reads", 0.0)
        out.append(_row("disk", i, r, disk_reads=int(reads), disk_bytes_before=int(held)))
    return out


# ---------------------------------------------------------------- admission


def vm_rss(pid: int) -> int:
    """``VmRSS`` of one process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Peak RSS every ``rss_s`` seconds and the KV gauges every ``metrics_s``, on a thread."""

    def __init__(self, pid: int, url: str, rss_s: float = 0.05, metrics_s: float = 0.5) -> None:
        self.pid, self.url = pid, url
        self.rss_s, self.metrics_s = rss_s, metrics_s
        self.peak_rss = 0
        self.rss_samples = 0
        self.max_waiting = 0.0
        self.max_running = 0.0
        self.max_queued = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        next_metrics = next_pids = 0.0
        pids = [self.pid]
        while not self._stop.wait(self.rss_s):
            if time.monotonic() >= next_pids:  # walking /proc every 50 ms would cost a core
                pids, next_pids = [self.pid, *descendants(self.pid)], time.monotonic() + 2.0
            self.peak_rss = max(self.peak_rss, sum(vm_rss(p) for p in pids))
            self.rss_samples += 1
            if time.monotonic() >= next_metrics:
                next_metrics = time.monotonic() + self.metrics_s
                try:
                    m = metrics(self.url)
                except httpx.HTTPError:
                    continue
                self.max_waiting = max(self.max_waiting, m.get("mlxd_kv_waiting_for_memory", 0))
                self.max_running = max(self.max_running, m.get("mlxd_requests_running", 0))
                self.max_queued = max(self.max_queued, m.get("mlxd_requests_waiting", 0))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _flood(target: Target, sizes: list[int], seed: int,
                 max_tokens: int | None) -> list[RequestResult]:
    """One streamed request per prompt size, all at once (no ``max_tokens`` when None)."""
    specs = [PromptSpec(prompt_tokens=n, seed=seed + i) for i, n in enumerate(sizes)]
    bodies = []
    for s in specs:
        body = request_body(target, Workload(spec=s, max_tokens=max_tokens or 0),
                            first_messages(s, 0))
        if max_tokens is None:
            body.pop("max_tokens")
        bodies.append(body)
    async with make_client(len(bodies), 1800.0) as client:
        return list(await asyncio.gather(*(stream_request(client, target, b, index=i,
                                                          timeout=1800.0)
                                           for i, b in enumerate(bodies))))


def transient_reserve(config: dict[str, Any]) -> int:
    """The transient reserve the server will count for the model (``mlxd serve``'s defaults:
    ``--prefill-step-size`` 2048, on CPU in chunks of 256, ``--max-num-seqs`` 16), the figure
    ``/v1/models`` shows as ``transient_reserve_bytes``."""
    from mlxd.engines.kernels.prefill import cpu_prefill_chunk
    from mlxd.models.memory import text_transient_bytes

    return text_transient_bytes(config, cpu_prefill_chunk(2048), prefill_rows=16,
                                decode_rows=16, dtype_bytes=4)


def flood(folder: Path, args: argparse.Namespace, env: dict[str, str], log_dir: Path,
          name: str, sizes: list[int], max_tokens: int | None, kv_tokens: int,
          *extra: str) -> dict[str, Any]:
    """A server whose budget leaves ``kv_tokens`` tokens of KV gets every prompt at once."""
    from mlxd.models.memory import kv_bytes_per_token, weights_bytes_of_folder

    config = json.loads((folder / "config.json").read_text())
    per_token = kv_bytes_per_token(config, 4)
    weights = weights_bytes_of_folder(folder)
    prefix = args.admission_prefix_mib * MIB
    transient = transient_reserve(config)
    budget = weights + prefix + transient + kv_tokens * per_token
    port = free_port()
    with tempfile.TemporaryDirectory() as home:
        spec = ServerSpec(f"mlxd-{name}", serve_argv(
            folder, port, Path(home), args.blas, "--memory-budget", str(budget),
            "--prefix-cache-bytes", str(prefix), "--kv-reserve-tokens", "1024", *extra),
            SERVED_NAME)
        with ServerProcess(spec, port, env, log_dir / f"kv_memory-{name}.log") as srv:
            target = Target(url=srv.url, model=SERVED_NAME)
            asyncio.run(_warm(target))
            time.sleep(1.0)
            idle_rss = rss_bytes(srv.pid)
            models = httpx.get(srv.url + "/v1/models", timeout=30, trust_env=False).json()
            held = sum(int(m.get("memory_bytes") or 0) for m in models["data"])
            served = sum(int(m.get("transient_reserve_bytes") or 0) for m in models["data"])
            start = time.monotonic()
            with Sampler(srv.pid, srv.url) as sampler:
                results = asyncio.run(_flood(target, sizes, 41000, max_tokens))
            seconds = time.monotonic() - start
            end = metrics(srv.url)
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.error is None else f"{r.status}:{r.error}"
        statuses[key] = statuses.get(key, 0) + 1
    margin = args.margin_mib * MIB
    row = {"name": name, "requests": len(results), "max_tokens": max_tokens,
           "server_flags": list(extra),
           "prompt_tokens": [r.prompt_tokens for r in results],
           "completion_tokens": [r.completion_tokens for r in results],
           "seconds": round(seconds, 1), "statuses": statuses,
           "all_ok": all(r.ok for r in results),
           "lost": sum(1 for r in results if not r.ok),
           "http_5xx": sum(1 for r in results if (r.status or 0) >= 500),
           "budget_bytes": budget, "weights_bytes": weights, "prefix_cache_bytes": prefix,
           "transient_reserve_bytes": transient, "transient_reserve_served": served,
           "kv_tokens_room": kv_tokens, "kv_bytes_per_token": per_token,
           "margin_bytes": margin, "idle_rss_bytes": idle_rss, "model_bytes_idle": held,
           "outside_budget_idle_bytes": idle_rss - held,
           "peak_rss_bytes": sampler.peak_rss, "rss_samples": sampler.rss_samples,
           "peak_over_budget_bytes": sampler.peak_rss - budget,
           "under_budget_plus_margin": sampler.peak_rss <= budget + margin,
           "preemptions": end.get("mlxd_kv_preemptions", 0.0),
           "max_waiting_for_memory": sampler.max_waiting,
           "max_running": sampler.max_running, "max_queued": sampler.max_queued,
           "peak_live_kv_bytes": end.get("mlxd_kv_peak_live_bytes", 0.0),
           "allowance_bytes": end.get("mlxd_kv_allowance_bytes", 0.0)}
    print(json.dumps(row), flush=True)
    return row


def admission(folder: Path, args: argparse.Namespace, env: dict[str, str],
              log_dir: Path) -> dict[str, Any]:
    """``limited``: N prompts of 2-3k tokens with ``max_tokens`` (their grants hold the
    whole output, so they wait instead of being preempted); ``unlimited``: prompts with no
    ``max_tokens`` under ``--kv-output-estimate 16``, so grants grow while they decode and
    the newest sequences are preempted (``--max-context`` bounds their answers)."""
    n = args.concurrent
    rows = [flood(folder, args, env, log_dir, "limited",
                  [2000 + (1000 * i) // max(1, n) for i in range(n)],
                  args.admission_max_tokens, args.kv_tokens)]
    if not args.no_preemption:
        m = max(2, n // 2)
        rows.append(flood(folder, args, env, log_dir, "unlimited", [1000] * m, None,
                          args.preempt_kv_tokens, "--kv-output-estimate", "16",
                          "--max-context", str(args.preempt_context)))
    return {"rows": rows}


# ---------------------------------------------------------------- report


def markdown(results: dict[str, Any]) -> str:
    lines = [f"## KV memory: disk tier and admission, {results['model']} ({results['blas']})",
             ""]
    d = results.get("disk_tier")
    if d and "error" not in d:
        lines += [f"Disk tier: TTFT of a {d['prefix_tokens']}-token prefix + ~100 tokens, "
                  f"median of {d['repeats']} repeats (cold: {d['cold_samples']} samples, "
                  f"disk: {d['disk_samples']} with `mlxd_prefix_cache_disk_reads` +1). RAM "
                  f"prefix cache {d['prefix_cache_bytes'] // MIB} MiB (one state), disk tier "
                  f"{d['prefix_cache_disk_bytes'] // MIB} MiB.", "",
                  "| state | TTFT s | cold / state | cached tokens |", "|---|---|---|---|"]
        cached = {s: [r["cached_tokens"] for r in d["rows"] if r["state"] == s]
                  for s in ("cold", "ram", "disk")}
        for state, key in (("cold", "cold_ttft_s"), ("ram", "ram_ttft_s"),
                           ("disk", "disk_ttft_s")):
            t = d[key]
            ratio = round(d["cold_ttft_s"] / t, 2) if t and d["cold_ttft_s"] else ""
            lines.append(f"| {state} | {t} | {ratio}x | {cached[state]} |")
        lines += ["", f"Disk read back vs RAM hit: {d['disk_over_ram']}x the TTFT. "
                      f"Target cold / disk >= 5x: {d['cold_over_disk']}x.", ""]
    elif d:
        lines += [f"Disk tier: {d['error']}", ""]
    a = results.get("admission")
    if a and "error" not in a:
        margin = a["rows"][0]["margin_bytes"] // MIB if a["rows"] else 0
        lines += ["Admission: every prompt sent at once to a server whose budget = weights + "
                  "prefix cache + transient reserve (what one step holds beyond the live KV, "
                  "`transient_reserve_bytes`) + KV for the tokens below. Target: peak RSS <= "
                  f"budget + a margin of {margin} MiB, what the process holds outside the "
                  "budget (Python, tokenizer, HTTP stack, MLX's allocator cache); idle: that "
                  "process's RSS over the bytes it accounts to the model after one request.",
                  "",
                  "| run | prompts (tokens) | max_tokens | KV room tokens | budget MiB | "
                  "transient reserve MiB | idle outside budget MiB | peak RSS MiB | peak - "
                  "budget MiB | target | statuses | lost | 5xx | preemptions | max waiting for "
                  "memory | peak live KV MiB | allowance MiB | most running / queued | seconds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in a["rows"]:
            toks = [t for t in r["prompt_tokens"] if t]
            met = "met" if r["under_budget_plus_margin"] else "**not met**"
            lines.append(
                f"| {r['name']} | {r['requests']} ({min(toks, default=0)}-"
                f"{max(toks, default=0)}) | {r['max_tokens'] or 'none'} | "
                f"{r['kv_tokens_room']} | {r['budget_bytes'] // MIB} | "
                f"{r.get('transient_reserve_bytes', 0) / MIB:.1f} | "
                f"{r['outside_budget_idle_bytes'] // MIB} | {r['peak_rss_bytes'] // MIB} | "
                f"{r['peak_over_budget_bytes'] // MIB} | {met} (+{r['margin_bytes'] // MIB}) | "
                f"{r['statuses']} | {r['lost']} | "
                f"{r['http_5xx']} | {int(r['preemptions'])} | "
                f"{int(r['max_waiting_for_memory'])} | {int(r['peak_live_kv_bytes']) // MIB} | "
                f"{int(r['allowance_bytes']) // MIB} | {int(r['max_running'])} / "
                f"{int(r.get('max_queued', 0))} | {r['seconds']} |")
        kept = all(r["all_ok"] and not r["lost"] for r in a["rows"])
        under = all(r["under_budget_plus_margin"] for r in a["rows"])
        lines += ["", f"Peak RSS under budget + {margin} MiB in every run: "
                      f"{'met' if under else 'NOT MET'}; every request completed: "
                      f"{'yes' if kept else 'NO'}."]
    elif a:
        lines += [f"Admission: {a['error']}"]
    return "\n".join(lines) + "\n"


def _guarded(fn: Any, *a: Any) -> dict[str, Any]:
    try:
        return dict(fn(*a))
    except Exception as e:  # the other part still runs; the report shows what failed
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.kv_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 repeat of a 1k-token prefix; 6 prompts at once")
    p.add_argument("--prefix-tokens", type=int, default=None, help="default 4000 (quick 1000)")
    p.add_argument("--repeats", type=int, default=None, help="disk tier repeats (default 3)")
    p.add_argument("--max-tokens", type=int, default=8, help="output of the disk tier requests")
    p.add_argument("--concurrent", type=int, default=None,
                   help="admission: prompts sent at once (default 12, quick 6)")
    p.add_argument("--admission-max-tokens", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=8192,
                   help="admission: KV tokens the budget leaves beside weights and prefix cache")
    p.add_argument("--admission-prefix-mib", type=int, default=128,
                   help="admission: --prefix-cache-bytes in MiB")
    p.add_argument("--margin-mib", type=int, default=256,
                   help="admission: what the process may hold outside the budget")
    p.add_argument("--no-preemption", action="store_true",
                   help="admission: skip the run without max_tokens (preemptions)")
    p.add_argument("--preempt-kv-tokens", type=int, default=4000,
                   help="admission without max_tokens: KV tokens the budget leaves")
    p.add_argument("--preempt-context", type=int, default=1600,
                   help="admission without max_tokens: --max-context (bounds the answers)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk tier part")
    p.add_argument("--no-admission", action="store_true", help="skip the admission part")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default="auto")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="kv_memory", help="result file names")
    args = p.parse_args(argv)
    args.prefix_tokens = args.prefix_tokens or (1000 if args.quick else 4000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.concurrent = args.concurrent or (6 if args.quick else 12)
    folder = args.model or smollm2_float32(args.home)
    env, blas = subprocess_env(args.blas)
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"model": folder.name, "blas": blas,
                               "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not args.no_disk:
        print("--- disk tier", flush=True)
        results["disk_tier"] = _guarded(disk_tier, folder, args, env, log_dir)
    if not args.no_admission:
        print("--- admission", flush=True)
        results["admission"] = _guarded(admission, folder, args, env, log_dir)
    write_report(args.out, args.tag, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
