"""``--require-qualified``: refuse entries whose qualification is missing, failed,
or about other bytes than the ones that would be served.

The registry entry's ``qualification`` summary is only a summary: anyone can
hand-write ``status: pass`` there. What counts is the qualification manifest
that ``mlxd model qualify`` writes (at a place derived from the entry, not from
anything the summary claims) and the sha256 of every model file it records,
which are recomputed from the files as they are now. Mtimes prove nothing
(``os.utime`` resets them), so they are used only as part of a cache key,
together with the inode change time, which no unprivileged process can reset.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.config import ServerConfig
from mlxd.models.file_hasher import FileHasher

QUALIFICATION_SCHEMA = "mlxd.qualification/1"


def artifact_path(entry: Any, home: Path) -> Path | None:
    """The files that would be served for ``entry`` when they are on this machine
    (a local folder or file, an installed ``pypi:`` package, or a cached hub snapshot)."""
    from mlxd.models.catalog import local_path_of
    from mlxd.sources.resolve import looks_like_hub_id

    path = local_path_of(entry, home)
    if path is not None or not looks_like_hub_id(entry.source):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(entry.source, revision=entry.revision,
                                      local_files_only=True))
    except Exception:  # not downloaded yet (or no huggingface_hub): nothing to check
        return None


def manifest_location(entry: Any, home: Path) -> Path:
    """Where ``mlxd model qualify`` writes the entry's qualification manifest."""
    from mlxd.sources.manifest import manifest_dir, manifest_path

    return manifest_path(manifest_dir(entry, home), "qualification")


def artifact_problem(path: Path, recorded: list[dict[str, Any]],
                     sha256: Callable[[Path], str]) -> str | None:
    """Why the files under ``path`` are not the ``recorded`` ones (None when they are)."""
    from mlxd.sources.manifest import artifact_files, verify_inventory

    base = path.parent if path.is_file() else path
    now = {str(p.relative_to(base)) for p in artifact_files(path)}
    added = sorted(now - {str(r.get("path")) for r in recorded})
    if added:
        return f"{added[0]}: added"
    problems = verify_inventory(base, recorded, sha256=sha256)
    return problems[0] if problems else None


def _manifest_problem(entry: Any, manifest: dict[str, Any]) -> str | None:
    if manifest.get("schema") != QUALIFICATION_SCHEMA:
        return f"the qualification manifest has schema {manifest.get('schema')!r}"
    if manifest.get("status") != "pass":
        return f"qualification status is {manifest.get('status')!r}"
    if manifest.get("source") != entry.source:
        return f"the qualification is for another source ({manifest.get('source')})"
    files = (manifest.get("artifact") or {}).get("files") or []
    if not files or not all(isinstance(f, dict) and f.get("sha256") for f in files):
        return "the qualification manifest records no sha256 of the model files " \
               "(re-run `mlxd model qualify`)"
    return None


def qualification_problem(entry: Any, home: Path,
                          hasher: FileHasher | None = None) -> str | None:
    """Why ``entry`` does not count as qualified, or None when it does.

    Blocking (it may hash gigabytes): call it from a worker thread in a server.
    """
    from mlxd.sources.manifest import ManifestError, read_manifest

    where = manifest_location(entry, home)
    claimed = (entry.qualification or {}).get("status")
    try:
        manifest = read_manifest(where)
    except ManifestError as e:
        if not where.exists():
            if claimed == "pass":
                return (f"the registry says its qualification passed, but no qualification "
                        f"manifest backs it ({where} is missing); run `mlxd model qualify`")
            return "no qualification (run `mlxd model qualify`)"
        return str(e)
    problem = _manifest_problem(entry, manifest)
    if problem:
        return problem
    path = artifact_path(entry, home)
    if path is None:
        return "the model files are not on this machine, so the qualification cannot be checked"
    changed = artifact_problem(path, manifest["artifact"]["files"],
                               (hasher or FileHasher()).sha256)
    if changed:
        return f"the artifact changed after it was qualified ({changed})"
    return None


def check_qualified(config: ServerConfig, catalog: Any,
                    hasher: FileHasher | None = None) -> None:
    """Raise ValueError naming every unqualified entry (only with --require-qualified)."""
    if not config.require_qualified:
        return
    hasher = hasher or FileHasher()
    problems = []
    for reg in catalog.registrations:
        problem = qualification_problem(reg.entry, config.home, hasher)
        if problem:
            problems.append(f"{reg.entry.name}: {problem}")
    if problems:
        raise ValueError("--require-qualified refuses to serve: " + "; ".join(problems))
