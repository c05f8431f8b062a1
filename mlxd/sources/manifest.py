"""Manifests: the JSON record each workflow step leaves next to its artifact.

Every manifest is schema-versioned (``mlxd.<step>/1``), written with sorted
keys and atomically (temp file + fsync + rename), and says what went in
(source, input manifests with their own sha256), what was done (the exact
command and recipe, tool versions, timestamps) and what came out (the file
inventory with sizes and sha256, and a status).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.jsonfile import atomic_write_text
from mlxd.sources.refs import slug

SCHEMA_VERSION = 1
MANIFEST_NAMES = {
    "acquisition": "acquisition.json",
    "conversion": "conversion.json",
    "registration": "registration.json",
    "qualification": "qualification.json",
}
# Files that describe an artifact rather than belong to it (left out of inventories).
MANIFEST_FILES = frozenset(MANIFEST_NAMES.values())
TOOL_PACKAGES = ("mlx", "mlx-lm", "mlx-vlm", "mlx-embeddings", "mlx-whisper", "gguf",
                 "huggingface-hub", "transformers", "tokenizers", "safetensors", "numpy")
# progress(done, total, what): absolute counts (bytes or steps) for a progress bar.
ProgressFn = Callable[[int, int, str], None]


class ManifestError(ValueError):
    """A manifest is missing, unreadable or of an unknown schema."""


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string with a ``Z`` suffix."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str) -> float:
    """Seconds since the epoch of an ISO-8601 timestamp written by :func:`utc_now`."""
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """Versions of mlxd, Python and the installed conversion/serving libraries."""
    out = {"mlxd": package_version("mlxd") or "unknown", "python": platform.python_version(),
           "platform": f"{sys.platform}-{platform.machine()}"}
    for name in (*TOOL_PACKAGES, *extra):
        version = package_version(name)
        if version is not None:
            out[name] = version
    return out


def sha256_of(path: Path, advance: Callable[[int], None] | None = None,
              chunk: int = 1 << 22) -> str:
    """The sha256 of a file; ``advance(n_bytes)`` is called after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
            if advance is not None:
                advance(len(block))
    return h.hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """One file of an artifact."""

    path: str
    size: int
    sha256: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def artifact_files(root: Path) -> list[Path]:
    """The files of an artifact (a file, or a folder's files minus manifests and hidden)."""
    root = Path(root)
    if root.is_file():
        return [root]
    files = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                and str(rel) not in MANIFEST_FILES:
            files.append(p)
    return files


def inventory(root: Path, *, hashes: bool = True,
              progress: ProgressFn | None = None) -> list[FileRecord]:
    """Name, size and sha256 of every file of an artifact (``root`` file or folder)."""
    root = Path(root)
    base = root.parent if root.is_file() else root
    files = artifact_files(root)
    total = sum(p.stat().st_size for p in files)
    done = 0
    records = []
    for p in files:
        def advance(n: int, name: str = p.name) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total, f"sha256 {name}")

        digest = sha256_of(p, advance) if hashes else None
        records.append(FileRecord(str(p.relative_to(base)), p.stat().st_size, digest))
    return records


def verify_inventory(base: Path, files: list[dict[str, Any]],
                     sha256: Callable[[Path], str] = sha256_of) -> list[str]:
    """Problems found re-hashing ``files`` (paths relative to ``base``); empty when all match.

    A same-size file is still re-hashed: a size check alone misses an edited byte.
    """
    problems = []
    for rec in files:
        path = Path(base) / str(rec.get("path"))
        if not path.is_file():
            problems.append(f"{rec.get('path')}: missing")
        elif path.stat().st_size != rec.get("size"):
            problems.append(f"{rec['path']}: size {path.stat().st_size} != {rec.get('size')}")
        elif rec.get("sha256") and sha256(path) != rec["sha256"]:
            problems.append(f"{rec['path']}: sha256 differs")
    return problems


def manifest_path(folder: Path, step: str) -> Path:
    """Where ``step``'s manifest lives for an artifact folder."""
    return Path(folder) / MANIFEST_NAMES[step]


def manifest_dir(entry: Any, home: Path) -> Path:
    """Where an entry's registration/qualification manifests live: beside a local folder
    artifact, else ``$MLXD_HOME/manifests/<name>``."""
    if not entry.source.startswith("pypi:"):
        path = Path(entry.source).expanduser()
        if path.is_dir():
            return path
    return home / "manifests" / slug(entry.name)


def new_manifest(step: str, *, command: list[str] | None = None) -> dict[str, Any]:
    """A manifest skeleton for ``step`` with schema, tool versions and a start time."""
    if step not in MANIFEST_NAMES:
        raise ManifestError(f"unknown manifest step {step!r}")
    return {"schema": f"mlxd.{step}/{SCHEMA_VERSION}", "step": step, "status": "running",
            "started_at": utc_now(), "command": list(command or []), "tools": tool_versions()}


def finish_manifest(manifest: dict[str, Any], status: str) -> dict[str, Any]:
    """Stamp ``status`` and the finish time (and the duration) on a manifest."""
    manifest["status"] = status
    manifest["finished_at"] = utc_now()
    manifest["seconds"] = round(parse_time(manifest["finished_at"])
                                - parse_time(manifest["started_at"]), 3)
    return manifest


def dumps(manifest: dict[str, Any]) -> str:
    """The canonical text of a manifest (sorted keys, two-space indent, newline)."""
    return json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_manifest(path: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest`` to ``path`` atomically; returns the path."""
    atomic_write_text(Path(path), dumps(manifest))
    Path(path).chmod(0o644)  # manifests are for everyone to read (mkstemp made it 0600)
    return Path(path)


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check one manifest."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} is not a readable manifest: {e}") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(schema, str) or not schema.startswith("mlxd."):
        raise ManifestError(f"{path} is not an mlxd manifest (schema {schema!r})")
    return data


def link_to(path: Path) -> dict[str, Any]:
    """A reference to another manifest: its path, schema and sha256 (tamper evidence)."""
    data = read_manifest(path)
    return {"manifest": str(Path(path).resolve()), "schema": data["schema"],
            "status": data.get("status"), "sha256": sha256_of(Path(path))}
