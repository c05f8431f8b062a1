"""Readable output of ``mlxd model ...``: rich tables on stdout, progress on stderr."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from mlxd.models.memory import format_bytes

ProgressFn = Callable[[int, int, str], None]


def print_json(data: Any) -> None:
    """Machine-readable output: sorted keys, two-space indent."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


@contextmanager
def progress_bar(console: Console, label: str, *, bytes_: bool = False,
                 enabled: bool = True) -> Iterator[ProgressFn | None]:
    """A ``progress(done, total, what)`` callback drawing a transient bar on stderr."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [TextColumn(f"{label} [dim]{{task.description}}"), BarColumn(),
               DownloadColumn() if bytes_ else MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("", total=None)

        def update(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, description=what[:40])

        yield update


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        if value is None or value == [] or value == {}:
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        table.add_row(key, str(value))
    return table


def _files_table(files: list[dict[str, Any]], limit: int = 20) -> Table:
    table = Table(title="files", title_justify="left")
    table.add_column("path")
    table.add_column("size", justify="right")
    table.add_column("sha256")
    for f in files[:limit]:
        table.add_row(f["path"], format_bytes(f.get("size")), (f.get("sha256") or "-")[:16])
    if len(files) > limit:
        table.add_row(f"... {len(files) - limit} more", "", "")
    return table


def _params(n: Any) -> str | None:
    if not isinstance(n, int) or n <= 0:
        return None
    return f"{n:,} ({n / 1e9:.2f}B)" if n >= 1e9 else f"{n:,} ({n / 1e6:.1f}M)"


def render_inspect(console: Console, r: dict[str, Any]) -> None:
    fit = r.get("fit") or {}
    fit_text = None
    if fit.get("estimate_bytes") is not None:
        fit_text = (f"{'fits' if fit['fits'] else 'does NOT fit'}: "
                    f"{format_bytes(fit['estimate_bytes'])} (weights "
                    f"{format_bytes(fit['weights_bytes'])} + reserve "
                    f"{format_bytes(fit['reserve_bytes'])}) of {format_bytes(fit['budget_bytes'])}")
    console.print(_kv_table(f"inspect {r.get('source', {}).get('spec', r.get('path'))}", [
        ("kind", f"{r.get('kind')} ({r.get('kind_reason')})"), ("adapter", r.get("adapter")),
        ("format", r.get("format")), ("architecture", r.get("architecture")),
        ("model_type", r.get("model_type")), ("parameters", _params(r.get("parameters"))),
        ("quantization", r.get("quantization")), ("dtypes", r.get("dtypes")),
        ("markers", r.get("markers")), ("context length", r.get("context_length")),
        ("sub-configs", r.get("subconfigs")), ("chat template", r.get("chat_template")),
        ("tokenizer", r.get("tokenizer")), ("MLX format", r.get("mlx_format")),
        ("loadable as is", r.get("loadable_as_is")),
        ("needs conversion", r.get("needs_conversion")), ("converter", r.get("converter")),
        ("note", r.get("conversion_note")), ("fit", fit_text or fit.get("error")),
        ("total size", format_bytes(r.get("total_bytes"))), ("warnings", r.get("warnings")),
    ]))
    if r.get("files"):
        console.print(_files_table(r["files"]))


def render_manifest(console: Console, title: str, m: dict[str, Any],
                    extra: list[tuple[str, Any]] | None = None) -> None:
    outputs = m.get("outputs") or {}
    console.print(_kv_table(title, [
        ("status", m.get("status")), ("artifact", outputs.get("artifact")),
        *(extra or []), ("seconds", m.get("seconds")),
    ]))
    if m.get("files"):
        console.print(_files_table(m["files"]))


def render_plan(console: Console, plan: dict[str, Any]) -> None:
    console.print(_kv_table("conversion plan (dry run: nothing written)", [
        ("input", plan["input"]), ("format", plan["input_format"]), ("kind", plan["kind"]),
        ("architecture", plan["architecture"]), ("converter", plan["converter"]),
        ("dtype", plan["dtype"]), ("quantize", plan["quantize"]), ("output", plan["output"]),
        ("input manifest", plan["input_manifest"]),
    ]))
    for i, step in enumerate(plan["steps"], 1):
        console.print(f"  {i}. {step}")


def render_registration(console: Console, m: dict[str, Any]) -> None:
    console.print(_kv_table(f"registered {m['name']}", [
        ("registry", m.get("registry")), ("entry", m.get("entry")),
        ("adapter of", m.get("base")), ("adapter", (m.get("artifact") or {}).get("path")
                                        if m.get("base") else None),
        ("replaced", m.get("replaced")), ("pushed", m.get("pushed")),
        ("linked manifests", [i["manifest"] for i in m.get("inputs", [])]),
    ]))


def render_qualification(console: Console, m: dict[str, Any]) -> None:
    table = Table(title=f"qualify {m['name']} ({m['kind']}): {m['status'].upper()}",
                  title_justify="left")
    for col in ("check", "result", "detail", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for name, c in m["checks"].items():
        mark = {True: "[green]pass[/green]", False: "[red]FAIL[/red]",
                None: "skip"}[c["passed"]]
        table.add_row(name, mark, str(c["detail"])[:100], f"{c['seconds']:.2f}")
    console.print(table)
    console.print(_kv_table("figures", sorted(m.get("figures", {}).items())))


def _facts(facts: dict[str, Any]) -> str:
    """Scalar facts as ``key=value`` (lists joined); nested figures left to --json."""
    parts = []
    for key, value in sorted(facts.items()):
        if isinstance(value, list):
            value = ",".join(map(str, value)) or "-"
        if value is not None and not isinstance(value, dict):
            parts.append(f"{key}={value}")
    return " ".join(parts)


def render_chain(console: Console, data: dict[str, Any]) -> None:
    entry = dict(data["entry"])
    q = entry.pop("qualification", None) or {}
    console.print(_kv_table(f"model {data['name']}", [
        ("registry", data["registry"]), ("entry", entry),
        ("qualification", f"{q.get('status')} at {q.get('finished_at')}" if q else "none"),
        ("figures", q.get("figures")), ("manifests", data["manifest_dir"])]))
    table = Table(title="chain (newest step first)", title_justify="left")
    for col in ("step", "status", "finished", "seconds", "facts"):
        table.add_column(col)
    for c in data["chain"]:
        table.add_row(c["step"], str(c["status"]), str(c["finished_at"])[:19],
                      str(c["seconds"]), _facts(c["facts"]))
    console.print(table)
    for c in data["chain"]:
        console.print(f"  {c['step']}: {c['manifest']}", highlight=False)
    if data["verified"]:
        if data["problems"]:
            for p in data["problems"]:
                console.print(f"[red]problem:[/red] {p}")
        else:
            console.print("[green]verified:[/green] manifest links and file hashes match")
