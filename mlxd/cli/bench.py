"""``mlxd bench``: load-test any OpenAI-compatible server over HTTP and report per level.

Exit status: 0 when every request succeeded, 1 when some failed (they are
counted in the report), 2 for bad arguments or a refused target.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxd.cli.bench_trace import add_arguments as add_trace_arguments
from mlxd.cli.bench_trace import run_trace

# The default level sizes: each level sends this many requests per stream.
REQUESTS_PER_STREAM = 2
MAX_REQUESTS = 100_000


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,8,16, got {text!r}") from None
    if not values or any(v < 1 or v > 1024 for v in values):
        raise argparse.ArgumentTypeError("concurrency levels must be between 1 and 1024")
    return values


def add_parser(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=(
        "Stream requests to an OpenAI-compatible server at each concurrency level and report "
        "output tok/s, per-stream decode tok/s, TTFT, inter-token latency, cached tokens and "
        "errors. Prompts are built from common English words, about one token each (see "
        "docs/benchmarks.md)."))
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--model", default="default", help="model name sent in every request")
    p.add_argument("--api", choices=["chat", "completions", "messages"], default=None,
                   help="/v1/chat/completions (default), /v1/completions, or /v1/messages "
                        "(--trace only; its default)")
    p.add_argument("--api-key", default=os.environ.get("MLXD_API_KEY"),
                   help="Bearer key (default $MLXD_API_KEY)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 8, 16],
                   help="comma-separated concurrent streams per level (default 1,4,8,16)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per level (default {REQUESTS_PER_STREAM} x concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="leading prompt tokens shared by every request")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default 64; 256 with --trace)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--multi-turn", type=int, default=1, metavar="N",
                   help="N-turn conversations; each turn counts as one request")
    p.add_argument("--turn-tokens", type=int, default=32,
                   help="approximate length of each follow-up user message")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--warmup", type=int, default=1, help="unreported requests before the levels")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per level")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON merged into every request, e.g. \'{"top_k": 1}\'')
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE",
                   help="write a PNG plot (needs matplotlib: pip install 'mlxd[bench]')")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a target that is not this machine (loopback)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_trace_arguments(p)
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> str | None:
    """The reason the arguments cannot run, or None."""
    from mlxd.benchmark.loadgen import is_loopback_url

    if not args.url.startswith(("http://", "https://")):
        return f"--url must start with http:// or https:// (got {args.url!r})"
    if not args.allow_remote and not is_loopback_url(args.url):
        return (f"refusing to load-test {args.url}: it is not this machine (127.0.0.0/8, ::1 or "
                "localhost). Pass --allow-remote if you own that server.")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib, which this install lacks: pip install 'mlxd[bench]'"
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        return f"--requests must be between 1 and {MAX_REQUESTS}"
    if args.prompt_tokens < 1 or (args.max_tokens or 1) < 1 or args.multi_turn < 1:
        return "--prompt-tokens, --max-tokens and --multi-turn must be at least 1"
    if not 0 <= args.shared_prefix_tokens <= args.prompt_tokens:
        return "--shared-prefix-tokens must be between 0 and --prompt-tokens"
    if args.timeout <= 0 or args.max_duration <= 0:
        return "--timeout and --max-duration must be positive"
    return None


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int], Callable[[Any], None]]]:
    """Yields ``on_level(concurrency, n)`` -> per-request callback that advances a rich bar."""
    if not enabled:
        yield lambda _c, _n: (lambda _r: None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                        console=Console(stderr=True))

    def on_level(concurrency: int, n: int) -> Callable[[Any], None]:
        task = progress.add_task(f"concurrency {concurrency:>3}", total=n, errors=0)
        errors = [0]

        def advance(result: Any) -> None:
            errors[0] += 0 if result.ok else 1
            progress.update(task, advance=1, errors=errors[0])

        return advance

    with progress:
        yield on_level


def build_report(args: argparse.Namespace, levels: list[Any], started: float) -> dict[str, Any]:
    """The JSON document of one ``mlxd bench`` run."""
    from mlxd.benchmark.report import summarize_level

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("run", "api_key", "command")}
    return {"tool": "mlxd bench", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                             time.gmtime(started)),
            "target": {"url": args.url, "model": args.model, "api": args.api},
            "config": config, "levels": [summarize_level(lv) for lv in levels]}


def run(args: argparse.Namespace) -> int:
    from mlxd.benchmark.loadgen import Target, Workload, run_levels
    from mlxd.benchmark.prompts import PromptSpec
    from mlxd.benchmark.report import markdown_table, plot_levels, write_json

    if args.trace is None and args.write_trace is None:
        args.api = args.api or "chat"
        args.max_tokens = 64 if args.max_tokens is None else args.max_tokens
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.trace is not None or args.write_trace is not None:
        return run_trace(args)
    if args.api == "messages":
        print("error: --api messages needs --trace", file=sys.stderr)
        return 2
    target = Target(url=args.url, model=args.model, api=args.api, api_key=args.api_key)
    spec = PromptSpec(prompt_tokens=args.prompt_tokens,
                      shared_prefix_tokens=args.shared_prefix_tokens,
                      turn_tokens=args.turn_tokens, seed=args.seed)
    workload = Workload(spec=spec, max_tokens=args.max_tokens, temperature=args.temperature,
                        multi_turn=args.multi_turn, timeout=args.timeout,
                        max_duration=args.max_duration, extra_body=args.extra_body)

    def per_level(c: int) -> int:
        return int(args.requests or max(REQUESTS_PER_STREAM * c, args.multi_turn))

    started = time.time()
    show = not args.no_progress
    with progress_bar(show) as on_level:
        levels = asyncio.run(run_levels(target, workload, args.concurrency, per_level,
                                        warmup=args.warmup, on_level=on_level))
    report = build_report(args, levels, started)
    print(markdown_table(report["levels"], title=f"{args.model} at {args.url}"))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot_levels(args.plot, {args.model: report["levels"]})
    failed = sum(sum(lv["errors"].values()) for lv in report["levels"])
    return 1 if failed else 0
