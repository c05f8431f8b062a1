"""A bounded disk tier under the RAM prefix cache (``--prefix-cache-disk-bytes``).

When the RAM prefix cache evicts an entry, a copy of its KV state goes here instead of
disappearing; a later prompt that the RAM cache covers less well than a disk entry
reads that entry back into RAM. Files are ``<key>.safetensors`` in the format the
prefix cache saves at shutdown (mlx-lm's ``save_prompt_cache``) and a ``<key>.json``
beside it with the model identity, the namespace, the tokens, the file's size and its
SHA-256. Files are written by a thread of their own, never the model's; the sidecar is
written last, so a half-written entry is never listed. An entry whose file does not
match its checksum, or that another model wrote, is skipped with a log line and never
served. The tier survives restarts: a new process lists the folder. When it holds more
than its bytes, the least recently used entries are deleted.

Only states made of plain KV layers go to disk (a copy cut to exactly their tokens);
rotating, quantized and recurrent layers stay RAM-only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskEntry:
    key: str
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int
    sha256: str


def entry_key(namespace: str, tokens: list[int] | tuple[int, ...]) -> str:
    return hashlib.sha256(json.dumps([namespace, list(tokens)]).encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class DiskTier:
    """The disk tier of one model's prefix cache (thread-safe)."""

    def __init__(self, folder: Path, max_bytes: int, identity: str) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.identity = identity
        self._index: OrderedDict[str, DiskEntry] = OrderedDict()  # least recent first
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, list[int], list[Any]] | None] = queue.Queue()
        self.writes = 0
        self.reads = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="mlxd-prefix-disk")
        self._writer.start()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    # -- model thread ---------------------------------------------------------
    def wants(self, namespace: str, tokens: list[int], cache: list[Any]) -> bool:
        """Whether an evicted entry should be written: plain KV layers, not on disk yet
        (an entry already there counts as used now)."""
        if not tokens or any(type(c) not in (KVCache, QuantizedKVCache) or c.keys is None
                             for c in cache):
            return False
        key = entry_key(namespace, tokens)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
        return True

    def put(self, namespace: str, tokens: list[int], cache: list[Any]) -> None:
        """Queue an entry for writing: ``cache`` is a copy holding exactly ``tokens``'
        state, evaluated on the model's thread; the write happens off it."""
        self._queue.put((namespace, list(tokens), cache))

    def longest(self, namespace: str, tokens: list[int]) -> tuple[DiskEntry | None, int]:
        """The entry of ``namespace`` sharing the most leading ``tokens``, and how many
        (its states are plain KV: one longer than the prompt is cut back to it)."""
        best: DiskEntry | None = None
        n_best = 0
        with self._lock:
            for entry in self._index.values():
                if entry.namespace != namespace:
                    continue
                n = next((i for i, (a, b) in enumerate(zip(entry.tokens, tokens)) if a != b),
                         min(len(entry.tokens), len(tokens)))
                if n > n_best:
                    best, n_best = entry, n
        return best, n_best

    def read(self, entry: DiskEntry) -> list[Any] | None:
        """The entry's KV state, or None (the file is gone, or corrupt: then it is
        dropped with a log line)."""
        path = self.folder / f"{entry.key}.safetensors"
        try:
            if _file_sha256(path) != entry.sha256:
                raise ValueError("checksum mismatch")
            cache = load_prompt_cache(str(path))
        except Exception as e:
            log.warning("prefix cache disk tier: skipping %s: %s", path, e)
            self._drop(entry.key)
            return None
        with self._lock:
            if entry.key in self._index:
                self._index.move_to_end(entry.key)
        self.reads += 1
        return list(cache)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes, then stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout)

    # -- writer thread ----------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            namespace, tokens, cache = item
            try:
                self._write(namespace, tokens, cache)
            except Exception as e:  # a full disk must not stop the model
                log.warning("prefix cache disk tier: could not write an entry: %s", e)

    def _write(self, namespace: str, tokens: list[int], cache: list[Any]) -> None:
        key = entry_key(namespace, tokens)
        data = self.folder / f"{key}.safetensors"
        tmp = self.folder / f".{key}.tmp.safetensors"
        save_prompt_cache(str(tmp), cache, metadata={"namespace": namespace})
        os.replace(tmp, data)
        entry = DiskEntry(key, namespace, tuple(tokens), data.stat().st_size,
                          _file_sha256(data))
        side = {"model_identity": self.identity, "namespace": namespace, "tokens": tokens,
                "nbytes": entry.nbytes, "sha256": entry.sha256}
        tmp_side = self.folder / f".{key}.tmp.json"
        tmp_side.write_text(json.dumps(side))
        os.replace(tmp_side, self.folder / f"{key}.json")
        with self._lock:
            self._index[key] = entry
            self._index.move_to_end(key)
        self.writes += 1
        self._shrink()

    def _shrink(self) -> None:
        while True:
            with self._lock:
                total = sum(e.nbytes for e in self._index.values())
                if total <= self.max_bytes or not self._index:
                    return
                key = next(iter(self._index))
            self._drop(key)

    def _drop(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)
        for suffix in (".json", ".safetensors"):
            try:
                (self.folder / f"{key}{suffix}").unlink()
            except FileNotFoundError:
                pass

    def _scan(self) -> None:
        """List the entries a previous process left (oldest first), skipping foreign or
        unreadable ones with a log line."""
        sides = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for side in sides:
            try:
                info = json.loads(side.read_text())
                if info.get("model_identity") != self.identity:
                    log.warning("prefix cache disk tier: skipping %s: written by another "
                                "model (identity %s, this model is %s)", side,
                                str(info.get("model_identity"))[:12], self.identity[:12])
                    continue
                entry = DiskEntry(side.stem, str(info["namespace"]),
                                  tuple(int(t) for t in info["tokens"]), int(info["nbytes"]),
                                  str(info["sha256"]))
                if entry.key != entry_key(entry.namespace, entry.tokens):
                    raise ValueError("its name does not match its tokens")
            except Exception as e:
                log.warning("prefix cache disk tier: skipping %s: %s", side, e)
                continue
            self._index[entry.key] = entry
        self._shrink()
