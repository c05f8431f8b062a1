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

Pins keep a prompt prefix resident ahead of LRU eviction for a while
(Anthropic ``cache_control`` marks, OpenAI ``prompt_cache_key``): ``pin``
records the prefix when a request is admitted; the first stored state that
covers it is copied, cut to exactly the prefix, and held apart from the LRU
until the pin expires (each use renews it). Pinned states take at most half
of the cache's bytes; past that the pin closest to expiry goes first. A state
that cannot be cut back (a recurrent layer's) is pinned only when it ends
exactly at the prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Hashable
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlxd.engines.text.prefix_disk import DiskTier
from mlxd.engines.upstream import mlx_lm as lm_internals

log = logging.getLogger(__name__)

# How long a ``prompt_cache_key``'s prompt stays pinned after its last use (OpenAI
# keeps cached prefixes for 5-10 minutes of inactivity).
PROMPT_CACHE_KEY_TTL_S = 300.0

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


@dataclass
class _Pin:
    """A prefix kept resident until ``expires`` (monotonic seconds)."""

    namespace: str
    tokens: tuple[int, ...]
    ttl_s: float
    expires: float
    cache: list[Any] | None = None  # the state of exactly ``tokens``, once one was stored
    nbytes: int = 0


def cut_copy(cache: list[Any], keep: int) -> list[Any]:
    """A copy of ``cache``'s first ``keep`` tokens that holds only its own bytes. A plain
    KV layer copies just those tokens (never the whole state: a long prompt's state can
    be gigabytes); other layers are copied whole, then cut back."""
    out: list[Any] = []
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if type(layer) is KVCache and keys is not None and values is not None:
            copy: Any = KVCache()
            copy.keys = mx.contiguous(keys[..., :keep, :])
            copy.values = mx.contiguous(values[..., :keep, :])
            copy.offset = keep
            out.append(copy)
        elif type(layer) is QuantizedKVCache and keys is not None and values is not None:
            copy = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            copy.keys = tuple(mx.contiguous(x[..., :keep, :]) for x in keys)
            copy.values = tuple(mx.contiguous(x[..., :keep, :]) for x in values)
            copy.offset = keep
            out.append(copy)
        else:
            copy = deepcopy(layer)
            if getattr(copy, "offset", keep) > keep:
                copy.trim(copy.offset - keep)
            out.append(copy)
    mx.eval([c.state for c in out])
    return out


class PrefixCache:
    """Thread-safe prefix cache for one model."""

    def __init__(self, max_bytes: int, max_entries: int = 256, identity: str = "",
                 disk: DiskTier | None = None) -> None:
        self.max_bytes = max_bytes
        self.disk = disk  # where evicted entries go (prefix_disk.py), when configured
        self.identity = identity  # of the model whose KV states this cache holds
        self._cache = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self._text_namespace = _namespace(identity, (), None)
        self._pins: dict[Hashable, _Pin] = {}
        self.max_pinned_bytes = max_bytes // 2
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes + self.pinned_bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(p.nbytes for p in self._pins.values())

    def pin(self, tokens: list[int], ttl_s: float, namespace: str | None = None,
            owner: Hashable | None = None) -> None:
        """Keep ``tokens`` (a prompt prefix) resident for ``ttl_s`` seconds, ahead of LRU
        eviction, once a stored state covers it. ``owner`` names a pin that replaces the
        owner's previous one (a ``prompt_cache_key``); without one, the prefix is the pin."""
        if self.max_bytes <= 0 or not tokens or ttl_s <= 0:
            return
        ns = namespace or self._text_namespace
        key = owner if owner is not None else (ns, tuple(tokens))
        now = time.monotonic()
        with self._lock:
            pin = self._pins.get(key)
            if pin is not None and pin.namespace == ns and pin.tokens == tuple(tokens):
                pin.ttl_s = max(pin.ttl_s, ttl_s)
                pin.expires = max(pin.expires, now + ttl_s)
                return
            self._pins[key] = _Pin(ns, tuple(tokens), ttl_s, now + ttl_s)

    def pin_prompt(self, tokens: list[int], marks: tuple[tuple[int, float], ...],
                   key: str | None, namespace: str | None = None) -> None:
        """A request's pins: each ``(length, seconds)`` mark pins ``tokens[:length]``; a
        ``prompt_cache_key`` pins the whole prompt as that key's one prefix
        (``PROMPT_CACHE_KEY_TTL_S``), replacing the key's previous one."""
        for length, ttl_s in marks:
            self.pin(tokens[:length], ttl_s, namespace)
        if key is not None:
            ns = namespace or self._text_namespace
            self.pin(tokens, PROMPT_CACHE_KEY_TTL_S, namespace,
                     owner=("prompt_cache_key", ns, key))

    def _hold(self, namespace: str, tokens: list[int], cache: list[Any]) -> None:
        """Give waiting pins that ``tokens`` covers their state (a cut copy of ``cache``)."""
        for pin in self._pins.values():
            n = len(pin.tokens)
            if pin.cache is not None or pin.namespace != namespace or n > len(tokens) \
                    or tuple(tokens[:n]) != pin.tokens:
                continue
            if n < len(tokens) and not can_trim_prompt_cache(cache):
                continue
            pin.cache = cut_copy(cache, n)
            pin.nbytes = sum(c.nbytes for c in pin.cache)
        self._expire()

    def _expire(self) -> None:
        """Drop expired pins, then the soonest to expire while pins hold too many bytes."""
        now = time.monotonic()
        for key in [k for k, p in self._pins.items() if p.expires <= now]:
            del self._pins[key]
        while self.pinned_bytes > self.max_pinned_bytes:
            key = min((k for k, p in self._pins.items() if p.cache is not None),
                      key=lambda k: self._pins[k].expires)
            del self._pins[key]

    @staticmethod
    def _usable(pin: _Pin, namespace: str, tokens: list[int]) -> int:
        """How many leading ``tokens`` ``pin``'s state can supply: its whole prefix, or
        (a state that can be cut back) the part ``tokens`` shares with it."""
        if pin.cache is None or pin.namespace != namespace:
            return 0
        n = len(pin.tokens)
        if tuple(tokens[:n]) == pin.tokens:
            return n
        if not can_trim_prompt_cache(pin.cache):
            return 0
        return next((i for i, (a, b) in enumerate(zip(pin.tokens, tokens)) if a != b),
                    min(n, len(tokens)))

    def _pinned(self, namespace: str, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """The pinned state covering most of ``tokens`` (renewed when it covers most of
        its own prefix), leaving at least one token to process."""
        best, n = None, 0
        for pin in self._pins.values():
            usable = self._usable(pin, namespace, tokens)
            if usable >= len(tokens) and not can_trim_prompt_cache(pin.cache or []):
                continue  # a recurrent state must stop before the last token
            if usable > n:
                best, n = pin, usable
        if best is None or best.cache is None:
            return None, 0
        if 2 * n > len(best.tokens):  # a real use, not a template's shared first tokens
            best.expires = max(best.expires, time.monotonic() + best.ttl_s)
        cache = deepcopy(best.cache)
        n = min(n, len(tokens) - 1)
        if n < len(best.tokens):
            trim_prompt_cache(cache, len(best.tokens) - n)
        return cache, n

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
        ns = namespace or self._text_namespace
        if self.disk is not None:
            self._from_disk(ns, tokens)
        with self._lock:
            self._expire()
            cache, rest = self._cache.fetch_nearest_cache(ns, tokens)
            pinned, n_pinned = self._pinned(ns, tokens)
        if pinned is not None and (cache is None or n_pinned > len(tokens) - len(rest)):
            cache, rest = pinned, tokens[n_pinned:]
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
        ns = namespace or self._text_namespace
        with self._lock:
            pinned = max((self._usable(p, ns, tokens) for p in self._pins.values()),
                         default=0)
            found = lm_internals.prompt_trie(self._cache).search(ns, tokens)
            if found.exact is not None:
                return len(tokens)
            shorter = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > shorter:
                entry = lm_internals.prompt_trie(self._cache).get(found.model, found.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    return max(pinned, int(found.common_prefix))
            return max(pinned, shorter)

    def insert(self, tokens: list[int], cache: list[Any], namespace: str | None = None) -> None:
        """Cache ``cache``, the KV state of ``tokens``, under ``namespace``."""
        if self.max_bytes <= 0 or not tokens:
            return
        ns = namespace or self._text_namespace
        size = sum(c.nbytes for c in cache)  # from the shapes: nothing evaluated yet
        with self._lock:
            before = self._entries_locked() if self.disk is not None else []
            room = max(0, self.max_bytes - self.pinned_bytes)
            if size <= room:
                # Make room before the copy exists, not after: the LRU would evict only
                # once the new entry is in, holding one entry beyond its cap meanwhile.
                self._cache.trim_to(n_bytes=room - size)
        if size <= room:
            # Entries extracted from a running batch are lazy slices of the batch's
            # whole KV buffer; evaluate them (a layer at a time) so an entry holds only
            # its own bytes.
            for c in cache:
                mx.eval(c.state)
        with self._lock:
            self._hold(ns, list(tokens), cache)  # before the LRU may evict or trim it
            # the LRU gets what the pins leave of the byte budget
            self._cache.max_bytes = max(0, self.max_bytes - self.pinned_bytes)
            if size <= self._cache.max_bytes:  # a state larger than the cap is not copied
                self._cache.insert_cache(ns, list(tokens), cache)
            evicted = [(n, t, c) for n, t, c in before if not self._present(n, t)
                       and not (n == ns and tokens[:len(t)] == t)]  # not a prefix it replaced
        for n, t, c in evicted:
            assert self.disk is not None
            if self.disk.wants(n, t, c):  # a copy cut to its tokens, made on this thread
                self.disk.put(n, t, cut_copy(c, len(t)))

    def _present(self, namespace: str, tokens: list[int]) -> bool:
        try:
            lm_internals.prompt_trie(self._cache).get(namespace, tokens)
            return True
        except KeyError:
            return False

    def _from_disk(self, namespace: str, tokens: list[int]) -> None:
        """Read back the disk entry covering more of ``tokens`` than RAM does, if any."""
        assert self.disk is not None
        entry, n = self.disk.longest(namespace, tokens)
        if entry is None or n < 2 or n <= self.peek(tokens, namespace):
            return
        cache = self.disk.read(entry)
        if cache is not None:
            self.insert(list(entry.tokens), cache, namespace)

    def close(self) -> None:
        """Finish the disk tier's queued writes (model unloading)."""
        if self.disk is not None:
            self.disk.close()

    def clear(self) -> None:
        with self._lock:
            self._cache.trim_to(n_sequences=0)
            self._pins.clear()

    def entries(self) -> list[tuple[str, list[int], list[Any]]]:
        """Every cached (namespace, tokens, cache), least recently used first."""
        with self._lock:
            return self._entries_locked()

    def _entries_locked(self) -> list[tuple[str, list[int], list[Any]]]:
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
