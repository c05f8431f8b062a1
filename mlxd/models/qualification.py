"""``--require-qualified``: refuse entries whose qualification is missing,
failed, or older than the artifact it qualified."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from mlxd.config import ServerConfig


def _artifact_mtime(path: Path) -> float:
    if path.is_file():
        return path.stat().st_mtime
    times = [p.stat().st_mtime for p in path.rglob("*") if p.is_file()
             and p.name not in ("qualification.json", "registration.json")]
    return max(times) if times else path.stat().st_mtime


def qualification_problem(entry: Any, local_path: Path | None) -> str | None:
    """Why ``entry`` does not count as qualified, or None when it does."""
    q = entry.qualification
    if not q:
        return "no qualification (run `mlxd model qualify`)"
    if q.get("status") != "pass":
        return f"qualification status is {q.get('status')!r}"
    if q.get("source") not in (None, entry.source):
        return f"the qualification is for another source ({q.get('source')})"
    at = q.get("finished_at") or q.get("at")
    if not at:
        return "qualification has no timestamp"
    when = dt.datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp()
    if local_path is not None and local_path.exists() and _artifact_mtime(local_path) > when + 1:
        return "the artifact changed after it was qualified"
    return None


def check_qualified(config: ServerConfig, catalog: Any) -> None:
    """Raise ValueError naming every unqualified entry (only with --require-qualified)."""
    if not config.require_qualified:
        return
    from mlxd.models.catalog import local_path_of

    problems = []
    for reg in catalog.registrations:
        problem = qualification_problem(reg.entry, local_path_of(reg.entry, config.home))
        if problem:
            problems.append(f"{reg.entry.name}: {problem}")
    if problems:
        raise ValueError("--require-qualified refuses to serve: " + "; ".join(problems))
