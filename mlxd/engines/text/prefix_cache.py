"""Byte-bounded LRU cache of KV states keyed by token prefixes.

Built on mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction that
trims longer entries down to a shared prefix). Adds a lock, hit accounting,
and persistence to ``$MLXD_HOME/prefix-cache/<model>/``.

A saved cache records the identity of the model that wrote it (``model_identity``)
and is only restored into that same model: a served name re-pointed to other
weights, or a re-converted model, starts cold instead of reusing KV states that
another model computed.

Entries live in namespaces (the trie's per-"model" key): the model identity,
the hashes of the media behind a prompt's placeholder tokens and the
request's cache salt. Two prompts with the same tokens but different images
(or salts) never share a KV state; the same image with the same salt does.
A namespace is computed once per sequence, when it is admitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlxd.engines.upstream import mlx_lm as lm_internals

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")
_HASHED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def model_identity(path: Path) -> str:
    """A fingerprint of the model in ``path``: which KV states its caches hold.

    The resolved path, every weights file's name, size and mtime (a rewrite or
    re-conversion changes them), and the contents of the config and tokenizer
    files. Cheap: weights are stat'ed, not hashed.
    """
    root = Path(path).resolve()
    h = hashlib.sha256(str(root).encode())
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    for f in files:
        rel = f.relative_to(root).as_posix() if root.is_dir() else f.name
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
            st = f.stat()
            h.update(f"\0w:{rel}:{st.st_size}:{st.st_mtime_ns}".encode())
        elif f.is_file() and f.name in _HASHED_FILES:
            h.update(f"\0f:{rel}:".encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _namespace(identity: str, media_hashes: tuple[str, ...], salt: str | None) -> str:
    return json.dumps([identity, list(media_hashes), salt])


class PrefixCache:
    """Thread-safe prefix cache for one model."""

    def __init__(self, max_bytes: int, max_entries: int = 256, identity: str = "") -> None:
        self.max_bytes = max_bytes
        self.identity = identity  # of the model whose KV states this cache holds
        self._cache = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self._text_namespace = _namespace(identity, (), None)
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes

    def __len__(self) -> int:
        return len(self._cache)

    def namespace(self, media_hashes: tuple[str, ...] = (), salt: str | None = None) -> str:
        """The namespace of prompts with these media (in prompt order) and this salt."""
        if not media_hashes and salt is None:
            return self._text_namespace
        return _namespace(self.identity, media_hashes, salt)

    def fetch(self, tokens: list[int], namespace: str | None = None
              ) -> tuple[list[Any] | None, int]:
        """Return ``(cache, n_cached)``: a private copy covering ``tokens[:n_cached]``.

        Only entries of ``namespace`` (default: plain text prompts) can match.
        At least one token is always left to process, since generation needs
        the logits of the last prompt token.
        """
        if self.max_bytes <= 0 or len(tokens) < 2:
            return None, 0
        with self._lock:
            cache, rest = self._cache.fetch_nearest_cache(namespace or self._text_namespace,
                                                          tokens)
        if cache is None:
            self.misses += 1
            return None, 0
        n_cached = len(tokens) - len(rest)
        if n_cached >= len(tokens) and not can_trim_prompt_cache(cache):
            # A recurrent state covers exactly its tokens: use the nearest entry
            # that stops before the last token instead.
            with self._lock:
                cache, rest = self._cache.fetch_nearest_cache(
                    namespace or self._text_namespace, tokens[:-1])
            n_cached = len(tokens) - 1 - len(rest) if cache is not None else 0
        elif n_cached >= len(tokens):
            trim_prompt_cache(cache, n_cached - (len(tokens) - 1))
            n_cached = len(tokens) - 1
        if n_cached <= 0:
            self.misses += 1
            return None, 0
        self.hits += 1
        return cache, n_cached

    def peek(self, tokens: list[int], namespace: str | None = None) -> int:
        """How many of ``tokens`` a ``fetch`` would cover now, without copying a state
        (an exact or trimmable match may count the last token too)."""
        if self.max_bytes <= 0:
            return 0
        with self._lock:
            found = lm_internals.prompt_trie(self._cache).search(namespace or self._text_namespace, tokens)
            if found.exact is not None:
                return len(tokens)
            shorter = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > shorter:
                entry = lm_internals.prompt_trie(self._cache).get(found.model, found.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    return int(found.common_prefix)
            return shorter

    def insert(self, tokens: list[int], cache: list[Any], namespace: str | None = None) -> None:
        """Cache ``cache``, the KV state of ``tokens``, under ``namespace``."""
        if self.max_bytes <= 0 or not tokens:
            return
        # Entries extracted from a running batch are lazy slices of the batch's
        # whole KV buffer; evaluate them so an entry holds only its own bytes.
        mx.eval([c.state for c in cache])
        with self._lock:
            self._cache.insert_cache(namespace or self._text_namespace, list(tokens), cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.trim_to(n_sequences=0)

    def entries(self) -> list[tuple[str, list[int], list[Any]]]:
        """Every cached (namespace, tokens, cache), least recently used first."""
        with self._lock:
            out = []
            for namespace, toks in lm_internals.lru_entries(self._cache):
                entry = lm_internals.prompt_trie(self._cache).get(namespace, toks)
                out.append((namespace, list(toks), entry.prompt_cache))
            return out

    def save(self, folder: Path) -> int:
        """Write every entry to ``folder`` (replacing it atomically); returns the count."""
        entries = self.entries()
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        for i, (namespace, toks, cache) in enumerate(entries):
            save_prompt_cache(str(tmp / f"{i:05d}.safetensors"), cache,
                              metadata={"tokens": json.dumps(toks), "namespace": namespace})
        (tmp / "index.json").write_text(json.dumps({"entries": len(entries),
                                                    "model_identity": self.identity}))
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
        return len(entries)

    def restore(self, folder: Path) -> int:
        """Load entries saved by ``save`` by this same model; unreadable files are skipped.

        A cache written by another model (or one without an identity) is
        ignored with a log line; the next save replaces it.
        """
        try:
            index = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            return 0
        saved_by = index.get("model_identity") if isinstance(index, dict) else None
        if saved_by != self.identity:
            log.warning("not restoring the prefix cache in %s: it was saved by a different "
                        "model (identity %s, this model is %s)", folder,
                        str(saved_by)[:12], self.identity[:12])
            return 0
        n = 0
        for path in sorted(folder.glob("*.safetensors")):
            try:
                cache, meta = load_prompt_cache(str(path), return_metadata=True)
                self.insert(json.loads(meta["tokens"]), cache, meta.get("namespace"))
                n += 1
            except Exception as e:  # a stale or corrupt file must not stop a load
                log.warning("skipping prefix cache file %s: %s", path, e)
        return n
