"""A follower rank of a sharded group: no HTTP, it replays rank 0's decoder calls.

The process connects to rank 0's control port (retrying while rank 0
starts), sends a heartbeat from its own thread (so a rank stuck in a
collective still reads as alive, and a stopped process does not), and
replays each message on its shard: the load, every decoder call and every
prefix-cache fetch and insert. Its sampler contributes zeros to the
all-sum that carries rank 0's tokens (``engines/distributed/sharded.py``).
Any failure here ends the process: a group that disagrees cannot decode.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from mlxd.engines.distributed.sharded import (
    GREEDY_GROUP,
    ShardedLanguageModel,
    broadcast_tokens,
    join_group,
    load_shard,
)
from mlxd.engines.kernels.prefill import install_cpu_prefill_attention
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.prefix_cache import PrefixCache, model_identity
from mlxd.runtime.distributed import (
    HEARTBEAT_S,
    GroupOptions,
    low_latency,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)


class Follower:
    """One follower rank's model, decoder and mirrored prefix cache."""

    def __init__(self, group: Any, sock: socket.socket) -> None:
        self.group = group
        self.sock = sock
        self._send_lock = threading.Lock()
        self.model: Any = None
        self.path = ""
        self.options: dict[str, Any] = {}
        self.decoder: LMBatchDecoder | None = None
        self.prefix: PrefixCache | None = None
        self.uids: dict[int, int] = {}  # rank 0's uid -> this rank's uid
        self.caches: dict[int, list[Any]] = {}  # this step's KV states, by rank 0's uid
        self.fetched: tuple[list[Any] | None, int] = (None, 0)
        self._samplers: dict[int, Any] = {GREEDY_GROUP: self._zeros()}

    def _zeros(self) -> Any:
        group = self.group

        def sample(logprobs: mx.array) -> mx.array:
            return broadcast_tokens(mx.zeros(logprobs.shape[:-1], dtype=mx.int32), group)

        return sample

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            send_frame(self.sock, message)

    def heartbeat(self) -> None:
        """Say this rank is alive, with its memory, until the connection ends."""
        while True:
            try:
                self.send({"op": "beat", "memory_bytes": int(mx.get_active_memory())})
            except OSError:
                return
            time.sleep(HEARTBEAT_S)

    def serve(self) -> None:
        """Replay rank 0's messages until it closes the connection."""
        while True:
            try:
                message = recv_frame(self.sock)
            except OSError:  # reset: rank 0 closed with our heartbeats unread
                return
            if message is None:
                return
            getattr(self, "op_" + str(message.get("op")))(message)

    # -- lifecycle --------------------------------------------------------
    def op_load(self, m: dict[str, Any]) -> None:
        self.path, self.options = m["path"], m
        self.model, _, _, _ = load_shard(m["path"], self.group)
        # As rank 0's load does (same numerics); held for the life of this process.
        install_cpu_prefill_attention(self.model, ShardedLanguageModel.HOST_GEMV)

    def op_decoder(self, m: dict[str, Any]) -> None:
        opts = self.options
        self.decoder = LMBatchDecoder(self.model, eos_ids=list(m["eos"]),
                                      max_num_seqs=opts["max_num_seqs"],
                                      prefill_step_size=opts["prefill_step_size"])
        self.prefix = PrefixCache(opts["prefix_cache_bytes"],
                                  identity=model_identity(Path(self.path)))
        self.send({"op": "loaded"})

    def op_unload(self, m: dict[str, Any]) -> None:
        if self.decoder is not None:
            self.decoder.close()
        self.model = self.decoder = self.prefix = None
        self.uids.clear()
        self.caches.clear()

    # -- decoder calls ----------------------------------------------------
    def _decoder(self) -> LMBatchDecoder:
        if self.decoder is None:
            raise RuntimeError("a decoder call arrived before the model loaded")
        return self.decoder

    def op_insert(self, m: dict[str, Any]) -> None:
        cache, n_cached = self.fetched if m["cached"] else (None, 0)
        self.fetched = (None, 0)
        if n_cached != m["n_cached"]:
            raise RuntimeError(f"prefix cache diverged: {n_cached} != {m['n_cached']} tokens")
        group = int(m["sampler"])
        sampler = self._samplers[GREEDY_GROUP] if group == GREEDY_GROUP else self._zeros()
        prompt: Any = SimpleNamespace(tokens=list(m["tokens"]))
        uid = self._decoder().insert(prompt, n_cached, cache, sampler, [], set(m["stop"]),
                                     int(m["max_tokens"]))
        self.uids[int(m["uid"])] = uid

    def op_next(self, m: dict[str, Any]) -> None:
        self.caches.clear()
        back = {v: k for k, v in self.uids.items()}
        _, responses = self._decoder().next()
        for r in responses:
            if r.finish_reason is not None:
                leader_uid = back.get(r.uid)
                self.uids.pop(leader_uid, None)  # type: ignore[arg-type]
                if r.prompt_cache and leader_uid is not None:
                    self.caches[leader_uid] = r.prompt_cache

    def op_remove(self, m: dict[str, Any]) -> None:
        leader = [int(u) for u in m["uids"] if int(u) in self.uids]
        out = self._decoder().remove([self.uids[u] for u in leader], bool(m["caches"]))
        for u in leader:
            found = out.get(self.uids.pop(u))
            if found:
                self.caches[u] = found[0]

    def op_extract(self, m: dict[str, Any]) -> None:
        leader = [int(u) for u in m["uids"] if int(u) in self.uids]
        out = self._decoder().extract_cache([self.uids[u] for u in leader])
        for u in leader:
            found = out.get(self.uids[u])
            if found:
                self.caches[u] = found[0]

    def op_chunk(self, m: dict[str, Any]) -> None:
        self._decoder().set_prefill_chunk(int(m["tokens"]))

    def op_reset(self, m: dict[str, Any]) -> None:
        self._decoder().reset()
        self.uids.clear()

    # -- the mirrored prefix cache ----------------------------------------
    def op_pc_fetch(self, m: dict[str, Any]) -> None:
        if self.prefix is not None:
            self.fetched = self.prefix.fetch(list(m["tokens"]), m.get("ns"))

    def op_pc_insert(self, m: dict[str, Any]) -> None:
        cache = self.caches.pop(int(m["uid"]), None)
        if self.prefix is None or cache is None:
            raise RuntimeError(f"no KV state of sequence {m['uid']} to cache")
        self.prefix.insert(list(m["tokens"]), cache, m.get("ns"))

    def op_pc_clear(self, m: dict[str, Any]) -> None:
        if self.prefix is not None:
            self.prefix.clear()


def _connect(options: GroupOptions, rank: int) -> socket.socket:
    """Connect to rank 0's control port, retrying while it starts (until killed)."""
    while True:
        try:
            sock = socket.create_connection((options.leader, options.port), timeout=5.0)
        except OSError:
            time.sleep(0.25)
            continue
        low_latency(sock).settimeout(None)
        send_frame(sock, {"op": "hello", "rank": rank, "pid": os.getpid()})
        return sock


def run_follower(options: GroupOptions) -> int:
    """Serve as a follower rank until rank 0 closes the group; the process exit code.

    A group forms once: after rank 0 unloads the model (or exits) the followers end,
    and ``mlx.launch`` ends with them. The sharded model is pinned for that reason."""
    group = join_group(options.backend)
    rank = group.rank()
    log.info("rank %d of %d: following %s:%d", rank, group.size(), options.leader, options.port)
    follower = Follower(group, _connect(options, rank))
    threading.Thread(target=follower.heartbeat, daemon=True).start()
    try:
        follower.serve()
    except Exception as e:
        log.exception("rank %d: replay failed", rank)
        try:
            follower.send({"op": "error", "error": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1
    finally:
        follower.sock.close()
    return 0  # rank 0 closed the group (shutdown or unload): so ends this rank
