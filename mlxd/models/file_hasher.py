"""sha256 of model files, cached until a file may have changed (``--require-qualified``
re-hashes what it serves; the catalog and the qualification check share one hasher)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


class FileHasher:
    """sha256 of files, cached by (path, size, mtime, ctime, inode, device).

    Any write to a file, and any ``os.utime`` on it, moves its ``st_ctime``, so a
    file changed behind our back is hashed again. Thread-safe: hashing runs in
    worker threads.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()
        self.hashed = 0  # files actually read (not served from the cache), for tests

    @staticmethod
    def _key(path: Path) -> tuple[Any, ...]:
        st = os.stat(path)
        return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                st.st_ino, st.st_dev)

    def sha256(self, path: Path) -> str:
        """The file's sha256, read again only when the file may have changed."""
        from mlxd.sources.manifest import sha256_of

        key = self._key(path)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        digest = sha256_of(path)
        with self._lock:
            self._cache[key] = digest
            self.hashed += 1
        return digest
