"""``mlxd ps | load | unload``: look at and steer a running server over HTTP."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    if name in ("load", "unload"):
        p.add_argument("model", help="model name")
    if name == "unload":
        p.add_argument("--no-wait", action="store_true",
                       help="fail with 409 instead of waiting for in-flight requests")
    p.add_argument("--url", default=os.environ.get("MLXD_URL", DEFAULT_URL),
                   help=f"server URL (default {DEFAULT_URL}, or $MLXD_URL)")
    p.add_argument("--api-key", default=os.environ.get("MLXD_API_KEY"),
                   help="API key (admin key for load/unload), or $MLXD_API_KEY")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(run={"ps": run_ps, "load": run_load, "unload": run_unload}[name])


def _client(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout)


def _fail(r: httpx.Response) -> int:
    try:
        body = r.json()
        message = (body.get("error") or {}).get("message") or r.text
    except ValueError:
        message = r.text
    print(f"error: HTTP {r.status_code}: {message}", file=sys.stderr)
    return 1


def _request(args: argparse.Namespace, method: str, path: str, **kw: Any) -> httpx.Response | None:
    try:
        with _client(args) as http:
            return http.request(method, path, **kw)
    except httpx.HTTPError as e:
        print(f"error: cannot reach mlxd at {args.url}: {e}", file=sys.stderr)
        return None


def _bytes(n: Any) -> str:
    from mlxd.models.memory import format_bytes

    return format_bytes(n) if isinstance(n, (int, float)) else "-"


def _ago(iso: str | None, now: datetime | None = None) -> str:
    """``last_used`` as an age ("3m ago"): short enough for an 80-column table."""
    if not iso:
        return "-"
    try:
        then = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def models_table(models: list[dict[str, Any]], now: datetime | None = None) -> Any:
    """The ``mlxd ps`` table, made to fit 80 columns (a terminal or a pipe): a model's
    aliases go on a line of their own under its name, pinned and in-use join the state,
    and the load count is left to ``--json``."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title="mlxd models", box=box.SIMPLE_HEAD, pad_edge=False)
    longest = max((len(line) for m in models
                   for line in [m["id"], *(f"  {a}" for a in m.get("aliases") or [])]), default=4)
    table.add_column("NAME", overflow="fold", min_width=min(longest, 32))
    table.add_column("KIND", no_wrap=True)
    table.add_column("STATE", overflow="fold", ratio=1)
    table.add_column("MEMORY", justify="right", no_wrap=True)
    table.add_column("LAST USED", justify="right", no_wrap=True)
    for m in models:
        name = Text(m["id"])
        if m.get("aliases"):
            name.append("".join(f"\n  {a}" for a in m["aliases"]), style="dim")
        state = [m.get("state", "-") if m.get("servable", True) else "cannot serve"]
        if m.get("pinned"):
            state.append("pinned")
        if m.get("in_use"):
            state.append(f"{m['in_use']} in use")
        table.add_row(name, m.get("kind", "-"), ", ".join(state),
                      _bytes(m.get("memory_bytes")), _ago(m.get("last_used"), now))
    return table


def run_ps(args: argparse.Namespace) -> int:
    r = _request(args, "GET", "/v1/models")
    if r is None:
        return 1
    if r.status_code != 200:
        return _fail(r)
    models = r.json()["data"]
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        from rich.console import Console

        Console().print(models_table(models))
    return 0


def _show(args: argparse.Namespace, card: dict[str, Any], verb: str) -> None:
    if args.json:
        print(json.dumps(card, indent=2))
    else:
        print(f"{card['id']}: {verb} (state {card['state']}, memory {_bytes(card['memory_bytes'])})")


def run_load(args: argparse.Namespace) -> int:
    r = _request(args, "POST", "/v1/models/load", json={"model": args.model})
    if r is None:
        return 1
    if r.status_code != 200:
        return _fail(r)
    _show(args, r.json(), "loaded")
    return 0


def run_unload(args: argparse.Namespace) -> int:
    r = _request(args, "POST", "/v1/models/unload",
                 json={"model": args.model, "wait": not args.no_wait})
    if r is None:
        return 1
    if r.status_code != 200:
        return _fail(r)
    card = r.json()
    _show(args, card, "unloaded" if card.get("unloaded") else "was not loaded")
    return 0
