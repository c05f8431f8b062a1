"""Build an output folder beside its final place, then move it there in one rename.

A process killed half-way leaves only a hidden ``.<name>.partial-<pid>``
folder (removed by the next run), never a half-written artifact under the
final name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxd.jsonfile import fsync_path


class OutputExists(ValueError):
    """The output path exists and replacing it was not asked for."""


def scratch_path(out: Path, tag: str = "partial") -> Path:
    """A hidden scratch path ``.<name>.<tag>-<pid>`` beside ``out`` for this process."""
    return out.with_name(f".{out.name}.{tag}-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(parent: Path, name: str) -> None:
    """Delete scratch paths ``.<name>.<tag>-<pid>`` left behind by dead processes."""
    if not parent.is_dir():
        return
    for p in parent.glob(f".{name}.*-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def check_output(out: Path, *, force: bool) -> None:
    """Refuse an existing ``out`` unless ``force``; say how to proceed."""
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists; pass --force to replace it or --out to "
                           "choose another folder")


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fsync_path(p)


def publish(staging: Path, out: Path) -> None:
    """Move a finished staging folder to ``out`` (an old ``out`` is swapped away first)."""
    _fsync_tree(staging)
    old = None
    if out.exists() or out.is_symlink():
        old = scratch_path(out, "old")
        os.replace(out, old)
    os.replace(staging, out)
    fsync_path(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


@contextmanager
def staged_folder(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder; on success it becomes ``out``, on error it is removed."""
    out = Path(out).absolute()
    check_output(out, force=force)
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent, out.name)
    staging = scratch_path(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first: leave no empty folders behind
            try:
                folder.rmdir()
            except OSError:
                break
        raise
