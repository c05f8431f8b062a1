"""Numbers of a trace replay: per turn (averaged over the sessions run together) and per
session; markdown tables of one server and of several side by side."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mlxd.benchmark.report import error_counts
from mlxd.benchmark.trace_replay import SessionResult


def _mean(values: Iterable[float | int | None], digits: int) -> float | None:
    items = [v for v in values if v is not None]
    return round(statistics.fmean(items), digits) if items else None


def turn_rows(sessions: Sequence[SessionResult]) -> list[dict[str, Any]]:
    """Per turn: requests, mean TTFT, decode tok/s, prompt / cached / output tokens."""
    turns = sorted({r.turn for s in sessions for r in s.results})
    out = []
    for t in turns:
        rows = [r for s in sessions for r in s.results if r.turn == t and r.ok]
        out.append({"turn": t, "ok": len(rows),
                    "ttft_s": _mean((r.ttft for r in rows), 3),
                    "decode_tok_s": _mean((r.decode_tok_s for r in rows), 1),
                    "prompt_tokens": _mean((r.prompt_tokens for r in rows), 1),
                    "cached_tokens": _mean((r.cached_tokens for r in rows), 1),
                    "output_tokens": _mean((r.output_tokens for r in rows), 1)})
    return out


def summarize(sessions: Sequence[SessionResult]) -> dict[str, Any]:
    """One run of ``len(sessions)`` sessions side by side."""
    walls = [s.wall_s for s in sessions if s.ok]
    started = min((s.started_at for s in sessions), default=0.0)
    finished = max((s.finished_at for s in sessions), default=0.0)
    results = [r for s in sessions for r in s.results]
    return {"sessions": len(sessions), "sessions_ok": len(walls),
            "session_wall_s": _mean(walls, 2),
            "session_wall_max_s": round(max(walls), 2) if walls else None,
            "run_wall_s": round(finished - started, 2),
            "requests": len(results), "errors": error_counts(results),
            "output_tokens": sum(r.output_tokens for r in results if r.ok),
            "turns": turn_rows(sessions),
            "per_session": [{"session": s.session, "wall_s": round(s.wall_s, 2),
                             "ok": s.ok, "prompt_tokens": [r.prompt_tokens for r in s.results]}
                            for s in sessions]}


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def markdown(summary: Mapping[str, Any], title: str) -> str:
    """One run as a table: a row per turn, then the session wall times."""
    lines = [f"### {title}: {summary['sessions']} session(s)", "",
             "| turn | ok | TTFT s | decode tok/s | prompt tok | cached tok | output tok |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for t in summary["turns"]:
        lines.append("| " + " | ".join(_cell(t[k]) for k in (
            "turn", "ok", "ttft_s", "decode_tok_s", "prompt_tokens", "cached_tokens",
            "output_tokens")) + " |")
    lines += ["", f"session wall time: mean {_cell(summary['session_wall_s'])} s, max "
              f"{_cell(summary['session_wall_max_s'])} s; {summary['sessions_ok']}/"
              f"{summary['sessions']} sessions complete; errors: {summary['errors'] or 'none'}",
              ""]
    return "\n".join(lines)


def comparison(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], reference: str) -> str:
    """Session wall time per server and session count, and each peer's time over the
    reference's (``x`` > 1: the reference is faster)."""
    counts = sorted({n for per in runs.values() for n in per})
    head = "| server | " + " | ".join(f"{n} session(s): wall s | x vs {reference}"
                                       for n in counts) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(counts)]
    for name, per in runs.items():
        cells = []
        for n in counts:
            wall = (per.get(n) or {}).get("session_wall_s")
            ref = (runs.get(reference, {}).get(n) or {}).get("session_wall_s")
            ratio = round(wall / ref, 2) if wall and ref else None
            cells += [_cell(wall), _cell(ratio if name != reference else None)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
