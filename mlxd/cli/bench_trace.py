"""``mlxd bench --trace agent|FILE``: replay coding-agent sessions against a server.

``agent`` is the generated trace (``mlxd.benchmark.agent_trace``): for each
``--sessions`` value N, N new sessions run side by side (no session is sent
twice, so the prefix cache only helps within a session and with the shared
system prompt). ``FILE`` is a JSONL trace (``mlxd.benchmark.trace_io``): all
its sessions run side by side, once. ``--write-trace FILE`` writes the agent
trace as such a file and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from mlxd.benchmark.trace_io import TraceApi, TraceRequest

DEFAULT_TRACE_MAX_TOKENS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trace flags of ``mlxd bench``."""
    p.add_argument("--trace", default=None, metavar="agent|FILE",
                   help="replay coding-agent sessions: 'agent' (the generated trace) or a "
                        "JSONL trace file; reports per-turn TTFT, decode tok/s, cached tokens "
                        "and session wall time")
    p.add_argument("--sessions", default="1,4",
                   help="with --trace agent: comma-separated sessions run side by side "
                        "(default 1,4)")
    p.add_argument("--turns", type=int, default=8, help="with --trace agent: turns per session")
    p.add_argument("--tools-in-system", action="store_true",
                   help="describe the tools in the system message instead of sending "
                        "'tools' (for servers whose chat template drops them)")
    p.add_argument("--write-trace", type=Path, default=None, metavar="FILE",
                   help="write the agent trace (--sessions, --turns, --seed) as JSONL and exit")


def _levels(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(not 1 <= v <= 64 for v in values):
        raise ValueError("--sessions takes numbers between 1 and 64, like 1,4")
    return values


def load_sessions(args: argparse.Namespace) -> tuple[list[list[list[TraceRequest]]], str]:
    """The sessions of each run and a description of the trace (its digest for agent)."""
    from mlxd.benchmark.agent_trace import TraceSpec, build_trace
    from mlxd.benchmark.trace_io import agent_requests, read_trace_file

    if args.trace not in (None, "agent"):
        return [read_trace_file(Path(args.trace))], f"trace file {args.trace}"
    levels = _levels(args.sessions)
    spec = TraceSpec(sessions=sum(levels), turns=args.turns, seed=args.seed,
                     max_tokens=args.max_tokens or DEFAULT_TRACE_MAX_TOKENS)
    trace = build_trace(spec)
    pool = agent_requests(trace, args.model)
    runs, start = [], 0
    for n in levels:
        runs.append(pool[start:start + n])
        start += n
    return runs, f"agent trace seed {spec.seed}, sha256 {trace.digest()[:16]} (Python " \
                 f"{trace.python})"


def write_trace(args: argparse.Namespace) -> int:
    from mlxd.benchmark.trace_io import write_trace_file

    runs, about = load_sessions(args)
    write_trace_file(args.write_trace, [s for run in runs for s in run])
    print(f"wrote {args.write_trace}: {about}")
    return 0


async def _run_all(target: Any, runs: list[list[list[TraceRequest]]], timeout: float,
                   show: bool) -> list[dict[str, Any]]:
    from mlxd.benchmark.trace_replay import replay, warm_up
    from mlxd.benchmark.trace_report import summarize

    await warm_up(target, timeout)
    out = []
    for sessions in runs:
        total = sum(len(s) for s in sessions)
        with _progress(show, f"{len(sessions)} session(s)", total) as advance:
            out.append(summarize(await replay(target, sessions, timeout, advance)))
    return out


def _progress(show: bool, label: str, total: int) -> Any:
    from contextlib import contextmanager

    @contextmanager
    def bar() -> Any:
        if not show:
            yield None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                      console=Console(stderr=True)) as progress:
            task = progress.add_task(label, total=total)
            yield lambda _r: progress.update(task, advance=1)

    return bar()


def run_trace(args: argparse.Namespace) -> int:
    """Replay the trace; exit 0 when every request succeeded, 1 otherwise, 2 bad input."""
    from mlxd.benchmark.report import write_json
    from mlxd.benchmark.trace_io import TraceFileError
    from mlxd.benchmark.trace_replay import TraceTarget
    from mlxd.benchmark.trace_report import markdown

    try:
        if args.write_trace:
            return write_trace(args)
        runs, about = load_sessions(args)
    except (ValueError, OSError, TraceFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    api: TraceApi = "chat" if args.api == "chat" else "messages"
    if args.api == "completions":
        print("error: --trace replays chat turns: use --api messages or --api chat",
              file=sys.stderr)
        return 2
    target = TraceTarget(url=args.url, model=args.model, api=api, api_key=args.api_key,
                         tools_in_system=args.tools_in_system)
    started = time.time()
    summaries = asyncio.run(_run_all(target, runs, args.timeout, not args.no_progress))
    print(f"{about}; {args.model} at {args.url} over /v1/"
          f"{'messages' if api == 'messages' else 'chat/completions'}\n")
    for s in summaries:
        print(markdown(s, args.model))
    if args.json:
        write_json(args.json, {"tool": "mlxd bench --trace", "trace": about,
                               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                           time.gmtime(started)),
                               "target": {"url": args.url, "model": args.model, "api": api},
                               "runs": summaries})
    return 0 if all(not s["errors"] for s in summaries) else 1
