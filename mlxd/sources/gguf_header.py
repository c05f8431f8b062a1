"""A fast reader of a GGUF file's header: metadata and the tensor table, no tensor data.

``gguf.GGUFReader`` builds numpy views of every field (seconds for a 50k-token
vocabulary); inspecting, detecting and estimating memory need only the
scalars, the array lengths and the tensor shapes, which this reads with
``struct`` from a memory map in milliseconds. Layout (GGUF v2/v3, little
endian): magic, version, tensor count, KV count, the KVs, the tensor infos.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays kept whole (small, and needed); others keep their length only.
KEEP_ARRAYS = ("general.languages", "general.tags")


class GGUFHeaderError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type{self.type_id}"


@dataclass
class GGUFHeader:
    """Metadata (arrays as their lengths unless kept) and tensor infos of a GGUF file."""

    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[GGUFTensorInfo] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture") or "")

    def a(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key (``llama.context_length`` for ``context_length``)."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        raise GGUFHeaderError(f"unknown GGUF value type {type_id}")

    def array(self, keep: bool) -> tuple[list[Any] | None, int]:
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if keep:
            return [self.value(item_type) for _ in range(count)], count
        if item_type == _STRING:
            for _ in range(count):
                self.skip_string()
        elif item_type in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item_type])
        else:  # nested arrays: walk them
            for _ in range(count):
                self.array(False) if item_type == _ARRAY else self.value(item_type)
        return None, count


def is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic (Ollama stores GGUFs without a suffix)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf_header(path: Path) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor table (raises ``GGUFHeaderError``)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(path, _Cursor(mm))
    except (struct.error, ValueError, OSError) as e:
        if isinstance(e, GGUFHeaderError):
            raise
        raise GGUFHeaderError(f"{path} is not a readable GGUF file: {e}") from None


def _parse(path: Path, cur: _Cursor) -> GGUFHeader:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise GGUFHeaderError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    header = GGUFHeader(path, version)
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    for _ in range(n_kv):
        key = cur.string()
        type_id = cur.unpack("<I")
        if type_id == _ARRAY:
            values, count = cur.array(keep=key in KEEP_ARRAYS)
            header.array_lengths[key] = count
            if values is not None:
                header.metadata[key] = values
        else:
            header.metadata[key] = cur.value(type_id)
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        type_id = cur.unpack("<I")
        cur.unpack("<Q")  # data offset
        header.tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), type_id))
    return header
