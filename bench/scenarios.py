"""The workloads of the side-by-side benchmark, each against one running server.

All traffic goes to 127.0.0.1, every request has a timeout and every loop a
bound. Each function returns a JSON-ready dict.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from mlxd.benchmark.loadgen import (
    RequestResult,
    Target,
    Workload,
    make_client,
    request_body,
    run_level,
    run_levels,
    stream_request,
)
from mlxd.benchmark.prompts import PromptSpec, first_messages
from mlxd.benchmark.report import error_counts, percentile, summarize_level


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


async def throughput(target: Target, levels: list[int], requests: Callable[[int], int],
                     prompt_tokens: int, max_tokens: int, max_duration: float,
                     ) -> list[dict[str, Any]]:
    """The same closed-loop workload at each concurrency level (greedy, no shared prefix)."""
    workload = Workload(spec=PromptSpec(prompt_tokens=prompt_tokens, seed=0),
                        max_tokens=max_tokens, temperature=0.0, timeout=300.0,
                        max_duration=max_duration, drain=120.0)
    done = await run_levels(target, workload, levels, requests, warmup=1)
    return [summarize_level(lv) for lv in done]


async def prefix_ttft(target: Target, prefix_tokens: int, repeats: int,
                      max_tokens: int = 8) -> dict[str, Any]:
    """TTFT of a request whose ``prefix_tokens``-token prefix is new (cold) vs the next
    request with the same prefix and a different ending (cached), ``repeats`` times."""
    cold: list[RequestResult] = []
    warm: list[RequestResult] = []
    async with make_client(2, 600.0) as client:
        for i in range(repeats):
            spec = PromptSpec(prompt_tokens=prefix_tokens + 100,
                              shared_prefix_tokens=prefix_tokens, seed=7000 + i)
            workload = Workload(spec=spec, max_tokens=max_tokens)
            for index, out in ((0, cold), (1, warm)):
                body = request_body(target, workload, first_messages(spec, index))
                out.append(await stream_request(client, target, body, index=index,
                                                timeout=600.0))
    cold_ttft = [r.ttft for r in cold if r.ok and r.ttft]
    warm_ttft = [r.ttft for r in warm if r.ok and r.ttft]
    c, w = _median(cold_ttft), _median(warm_ttft)
    return {"prefix_tokens": prefix_tokens, "repeats": repeats,
            "cold_ttft_s": c, "cached_ttft_s": w,
            "speedup": round(c / w, 2) if c and w else None,
            "prompt_tokens": [r.prompt_tokens for r in warm],
            "cold_cached_tokens": [r.cached_tokens for r in cold],
            "cached_tokens": [r.cached_tokens for r in warm],
            "errors": error_counts(cold + warm)}


async def conversation(target: Target, turns: int, prompt_tokens: int,
                       max_tokens: int) -> dict[str, Any]:
    """One ``turns``-turn conversation: per turn prompt tokens, cached tokens, TTFT."""
    workload = Workload(spec=PromptSpec(prompt_tokens=prompt_tokens, turn_tokens=32, seed=9000),
                        max_tokens=max_tokens, multi_turn=turns, timeout=300.0,
                        max_duration=900.0)
    summary = summarize_level(await run_level(target, workload, 1, turns))
    return {"turns": summary.get("turns", []), "errors": summary["errors"]}


def _gaps_between(results: list[RequestResult], lo: float, hi: float) -> list[float]:
    """Inter-chunk gaps that overlap the time window [lo, hi]."""
    return [b - a for r in results for a, b in itertools.pairwise(r.chunk_times)
            if b > lo and a < hi]


async def _await_decoding(results: list[RequestResult], tasks: list[asyncio.Task[Any]],
                          min_chunks: int, limit_s: float) -> None:
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline and not all(t.done() for t in tasks):
        if all(len(r.chunk_times) >= min_chunks for r in results):
            return
        await asyncio.sleep(0.05)


async def itl_under_long_prompt(target: Target, streams: int, max_tokens: int,
                                long_tokens: int) -> dict[str, Any]:
    """Inter-token latency of ``streams`` decoding streams while a ``long_tokens`` prompt
    arrives: over the whole run, before the arrival, and during its prefill."""
    spec = PromptSpec(prompt_tokens=128, seed=11000)
    workload = Workload(spec=spec, max_tokens=max_tokens)
    results = [RequestResult(index=i) for i in range(streams)]
    long_spec = PromptSpec(prompt_tokens=long_tokens, seed=12000)
    async with make_client(streams + 2, 900.0) as client:
        tasks = [asyncio.create_task(stream_request(
            client, target, request_body(target, workload, first_messages(spec, i)),
            index=i, timeout=900.0, result=results[i])) for i in range(streams)]
        await _await_decoding(results, tasks, min_chunks=4, limit_s=300.0)
        body = request_body(target, Workload(spec=long_spec, max_tokens=8),
                            first_messages(long_spec, 0))
        long = await stream_request(client, target, body, index=streams, timeout=900.0)
        await asyncio.gather(*tasks)
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps()]
    arrival = long.sent_at
    prefilled = long.chunk_times[0] if long.chunk_times else long.finished_at
    before = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times) if b <= arrival]
    during = _gaps_between(ok, arrival, prefilled)
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"streams": streams, "long_prompt_tokens": long.prompt_tokens,
            "long_ttft_s": round(long.ttft, 3) if long.ttft else None,
            "itl_p50_s": _r(p50), "itl_p99_s": _r(p99), "itl_max_s": _r(max(gaps, default=None)),
            "p99_over_p50": round(p99 / p50, 2) if p50 and p99 else None,
            "before_p50_s": _r(percentile(before, 50)),
            "during_p50_s": _r(percentile(during, 50)),
            "during_max_s": _r(max(during, default=None)),
            "errors": error_counts([*results, long])}


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


async def _sample_rss(read_rss: Callable[[], int], samples: list[int], stop: asyncio.Event,
                      ) -> None:
    while not stop.is_set():
        samples.append(read_rss())
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def _metrics_lines(url: str) -> list[str]:
    """Queue / batch gauges from ``/metrics`` when the server has them."""
    return [line for line in await _all_metrics(url) if not line.startswith("#")
            and any(k in line for k in ("queue", "running", "waiting", "batch"))][:20]


def _gauge_sum(lines: list[str], name: str) -> float:
    total = 0.0
    for line in lines:
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


async def _all_metrics(url: str) -> list[str]:
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
            resp = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return []
    return resp.text.splitlines() if resp.status_code == 200 else []


async def soak(target: Target, read_rss: Callable[[], int], concurrency: int, seconds: float,
               max_tokens: int, settle_s: float = 5.0) -> dict[str, Any]:
    """``concurrency`` closed-loop streams for ``seconds``; in-flight requests may finish
    (120 s grace). Checks: only 503 + Retry-After as errors, nothing lost, memory back."""
    workload = Workload(spec=PromptSpec(prompt_tokens=64, seed=13000), max_tokens=max_tokens,
                        timeout=300.0, max_duration=seconds, drain=120.0)
    rss_before = read_rss()
    cache_before = _gauge_sum(await _all_metrics(target.url), "mlxd_prefix_cache_bytes")
    samples: list[int] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(read_rss, samples, stop))
    level = await run_level(target, workload, concurrency, 10_000_000)
    stop.set()
    await sampler
    await asyncio.sleep(settle_s)
    rss_after = read_rss()
    after = await _all_metrics(target.url)
    # The prefix cache keeps KV states on purpose (bounded by --prefix-cache-bytes);
    # what it grew by is reported apart from what the process failed to give back.
    cache_growth = max(0.0, _gauge_sum(after, "mlxd_prefix_cache_bytes") - cache_before)
    rss_rest = rss_after - cache_growth
    summary = summarize_level(level)
    errors = summary["errors"]
    n503 = errors.get("503", 0)
    lost = sum(n for k, n in errors.items() if k != "503")
    return {"concurrency": concurrency, "seconds": seconds, "sent": summary["requests_sent"],
            "ok": summary["ok"], "errors": errors, "http_503": n503,
            "http_503_with_retry_after": summary["retry_after_on_503"], "lost": lost,
            "aggregate_tok_s": summary["aggregate_tok_s"], "ttft_s": summary["ttft_s"],
            "rss_before_mb": round(rss_before / 2**20, 1),
            "rss_peak_mb": round(max(samples, default=0) / 2**20, 1),
            "rss_after_mb": round(rss_after / 2**20, 1),
            "rss_after_over_before": round(rss_after / rss_before, 3) if rss_before else None,
            "prefix_cache_growth_mb": round(cache_growth / 2**20, 1),
            "rss_after_without_cache_over_before": (round(rss_rest / rss_before, 3)
                                                     if rss_before else None),
            "running_after": _gauge_sum(after, "mlxd_requests_running") if after else None,
            "waiting_after": _gauge_sum(after, "mlxd_requests_waiting") if after else None,
            "metrics_after": await _metrics_lines(target.url)}
