"""Turn request timings into numbers: per-level summary, markdown table, JSON, PNG plot."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxd.benchmark.loadgen import LevelResult, RequestResult

SCHEMA = "mlxd.bench/1"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; None for no values."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return statistics.fmean(items) if items else None


def error_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    """Failed requests by HTTP status code or failure name (``timeout``, ``ConnectError``...)."""
    return dict(sorted(Counter(r.error_key for r in results if r.error_key).items()))


def cached_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """What the server reported as reused prompt tokens (None when it never said)."""
    seen = [r.cached_tokens for r in results if r.cached_tokens is not None]
    return {"reported": len(seen), "total": sum(seen) if seen else None,
            "max": max(seen) if seen else None,
            "requests_with_cache": sum(1 for c in seen if c > 0)}


def turn_summary(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-turn averages of a multi-turn run: prompt and cached tokens, TTFT."""
    out = []
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn and r.ok]
        out.append({
            "turn": turn, "requests": len(rows),
            "prompt_tokens_mean": _round(_mean(r.prompt_tokens for r in rows
                                               if r.prompt_tokens is not None), 1),
            "cached_tokens_mean": _round(_mean(r.cached_tokens for r in rows
                                               if r.cached_tokens is not None), 1),
            "cached_tokens": [r.cached_tokens for r in rows],
            "ttft_p50_s": _round(percentile([r.ttft for r in rows if r.ttft is not None], 50)),
        })
    return out


def summarize_level(level: LevelResult) -> dict[str, Any]:
    """The numbers of one concurrency level (seconds and tokens per second)."""
    ok = [r for r in level.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps()]
    decode = [d for r in ok if (d := r.decode_tok_s) is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "concurrency": level.concurrency,
        "requests_planned": level.requests,
        "requests_sent": len(level.results),
        "ok": len(ok),
        "errors": error_counts(level.results),
        "retry_after_on_503": sum(1 for r in level.results
                                  if r.status == 503 and r.retry_after is not None),
        "duration_s": _round(level.duration, 3),
        "output_tokens": output_tokens,
        "aggregate_tok_s": _round(output_tokens / level.duration, 2),
        "per_stream_decode_tok_s": {"p50": _round(percentile(decode, 50), 2),
                                    "mean": _round(_mean(decode), 2)},
        "ttft_s": {"p50": _round(percentile(ttfts, 50)), "p95": _round(percentile(ttfts, 95))},
        "itl_s": {"p50": _round(percentile(gaps, 50)), "p99": _round(percentile(gaps, 99)),
                  "max": _round(max(gaps) if gaps else None)},
        "prompt_tokens_mean": _round(_mean(r.prompt_tokens for r in ok
                                           if r.prompt_tokens is not None), 1),
        "cached_tokens": cached_summary(ok),
    }
    if any(r.turn > 1 for r in level.results):
        summary["turns"] = turn_summary(level.results)
    return summary


def _fmt(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) or scale != 1.0:
        return f"{value * scale:.{digits}f}"
    return str(value)


def _errors_cell(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def markdown_table(levels: Sequence[dict[str, Any]], title: str | None = None) -> str:
    """One row per concurrency level; latencies in milliseconds."""
    head = ("| concurrency | ok/sent | output tok/s | per-stream tok/s | TTFT p50 ms | TTFT p95 ms "
            "| ITL p50 ms | ITL p99 ms | cached tokens | errors |")
    rows = [f"### {title}\n" if title else "", head, "|" + "---|" * 10]
    for lv in levels:
        cached = lv["cached_tokens"]
        rows.append(
            f"| {lv['concurrency']} | {lv['ok']}/{lv['requests_sent']} "
            f"| {_fmt(lv['aggregate_tok_s'])} | {_fmt(lv['per_stream_decode_tok_s']['p50'])} "
            f"| {_fmt(lv['ttft_s']['p50'], 0, 1000)} | {_fmt(lv['ttft_s']['p95'], 0, 1000)} "
            f"| {_fmt(lv['itl_s']['p50'], 1, 1000)} | {_fmt(lv['itl_s']['p99'], 1, 1000)} "
            f"| {_fmt(cached['total'])} | {_errors_cell(lv['errors'])} |")
    for lv in levels:
        for t in lv.get("turns", []):
            rows.append(f"\nc={lv['concurrency']} turn {t['turn']}: prompt tokens "
                        f"{_fmt(t['prompt_tokens_mean'])}, cached tokens "
                        f"{_fmt(t['cached_tokens_mean'])}, TTFT p50 "
                        f"{_fmt(t['ttft_p50_s'], 0, 1000)} ms")
    return "\n".join(r for r in rows if r != "").rstrip() + "\n"


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON, atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA, **report}, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def plot_levels(path: Path, series: Mapping[str, Sequence[dict[str, Any]]]) -> None:
    """A PNG with output tok/s and TTFT p50 against concurrency, one line per series.

    Needs matplotlib (``pip install 'mlxd[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for name, levels in series.items():
        xs = [lv["concurrency"] for lv in levels]
        ax_tps.plot(xs, [lv["aggregate_tok_s"] or 0 for lv in levels], marker="o", label=name)
        ttft = [(lv["concurrency"], lv["ttft_s"]["p50"] * 1000) for lv in levels
                if lv["ttft_s"]["p50"] is not None]
        if ttft:
            ax_ttft.plot(*zip(*ttft, strict=True), marker="o", label=name)
    ax_tps.set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    ax_ttft.set(xlabel="concurrent streams", ylabel="ms", title="time to first token (p50)")
    for ax in (ax_tps, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
