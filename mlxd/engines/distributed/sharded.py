"""One text model sharded over an ``mx.distributed`` group; this is rank 0's side.

Rank 0 runs the whole server: HTTP, the scheduler, the prefix cache. Its
decoder (``GroupDecoder``) sends every call (insert, remove, next, ...) over
the control channel (``runtime/distributed_link.py``) before making it, and
each follower (``engines/distributed/follower.py``) replays it on its own
shard, so every rank enters each forward pass, and its collectives, with the
same batch. Sampling happens on rank 0 only: each sampler's tokens are
all-summed with the followers' zeros, which hands rank 0's choice (grammar
constraints and seeds included) to every rank inside the same graph. The
prefix cache is mirrored the same way (``MirroredPrefixCache``): rank 0's
fetches and inserts are replayed on each rank's own KV shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx

from mlxd.engines.kernels.prefill import cpu_prefill_chunk
from mlxd.engines.text.decoder import (
    CacheAndTokens,
    LogitsProcessor,
    PromptProgress,
    Sampler,
    StepStats,
    TokenResponse,
)
from mlxd.engines.text.engine import MLXLanguageModel
from mlxd.engines.text.input_processor import PreparedPrompt
from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
from mlxd.engines.text.prefix_cache import PrefixCache, model_identity
from mlxd.engines.text.sampling import greedy
from mlxd.engines.text.scheduler import BatchScheduler, SchedulerBase
from mlxd.errors import ModelLoadError, Overloaded
from mlxd.generation.events import Event
from mlxd.models.engine import EngineStats, GroupStats, RankMemory
from mlxd.runtime.channel import Reply, send_all
from mlxd.runtime.distributed import GroupOptions
from mlxd.runtime.distributed_link import GroupBroken, GroupLink

log = logging.getLogger(__name__)

CONNECT_DEADLINE_S = 120.0  # followers start with the leader; loading may take a while
LOAD_DEADLINE_S = 600.0
GREEDY_GROUP = 0  # the sampler group every greedy sequence shares (one batched call)


def join_group(backend: str) -> Any:
    """This process's ``mx.distributed`` group (every rank calls it once, at start)."""
    return mx.distributed.init(strict=True, backend=backend)


def broadcast_tokens(tokens: mx.array, group: Any) -> mx.array:
    """Rank 0's sampled tokens on every rank (the followers contribute zeros)."""
    return mx.distributed.all_sum(tokens.astype(mx.int32), group=group)


def load_shard(path: str, group: Any) -> tuple[Any, Any, dict[str, Any], str]:
    """This rank's shard of the model in ``path``: tensor-parallel when the architecture
    has ``shard`` and its heads divide by the group size, else pipeline-parallel.

    Like mlx-lm's ``sharded_load``, but from a local folder without a weights index,
    and refusing a tensor split that the head counts do not allow.
    """
    from pathlib import Path

    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(Path(path), lazy=True, strict=False)
    n = group.size()
    heads = [config.get("num_attention_heads", 0), config.get("num_key_value_heads")
             or config.get("num_attention_heads", 0)]
    if hasattr(model, "shard") and all(h and h % n == 0 for h in heads):
        model.shard(group)
        mode = "tensor"
    elif hasattr(getattr(model, "model", None), "pipeline"):
        model.model.pipeline(group)
        mode = "pipeline"
    else:
        raise ValueError(f"{config.get('model_type')} cannot be split over {n} ranks "
                         f"(no pipeline, and heads {heads} do not divide by {n})")
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # all loaded
    tokenizer = load_tokenizer(Path(path), {"trust_remote_code": False},
                               eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config, mode


class GroupDecoder:
    """``LMBatchDecoder`` on rank 0 whose every call is replayed by the followers."""

    def __init__(self, inner: LMBatchDecoder, link: GroupLink, group: Any) -> None:
        self.inner = inner
        self.link = link
        self.group = group
        self._next_group = GREEDY_GROUP + 1
        self._greedy = self._broadcasting(greedy)
        # id(cache) -> uid of the sequence it came from (this step's caches only)
        self._origin: dict[int, int] = {}

    def _broadcasting(self, sampler: Sampler) -> Sampler:
        group = self.group

        def sample(logprobs: mx.array) -> mx.array:
            return broadcast_tokens(sampler(logprobs), group)

        return sample

    def origin(self, cache: list[Any]) -> int | None:
        """The uid whose KV state ``cache`` is (to name it to the followers)."""
        return self._origin.get(id(cache))

    def next(self) -> tuple[list[PromptProgress], list[TokenResponse]]:
        self._origin.clear()
        self.link.send({"op": "next"})
        prompts, responses = self.inner.next()
        for r in responses:
            if r.finish_reason is not None and r.prompt_cache:
                self._origin[id(r.prompt_cache)] = r.uid
        return prompts, responses

    def stats(self) -> AbstractContextManager[StepStats]:
        return self.inner.stats()

    def insert(self, prompt: PreparedPrompt, n_cached: int, cache: list[Any] | None,
               sampler: Sampler, processors: list[LogitsProcessor], stop: set[int],
               max_tokens: int) -> int:
        if sampler is greedy:
            shared, group_id = self._greedy, GREEDY_GROUP
        else:
            shared, group_id = self._broadcasting(sampler), self._next_group
            self._next_group += 1
        uid = self.inner.insert(prompt, n_cached, cache, shared, processors, stop, max_tokens)
        self.link.send({"op": "insert", "uid": uid, "tokens": list(prompt.tokens),
                        "n_cached": n_cached, "cached": cache is not None,
                        "sampler": group_id, "stop": sorted(stop), "max_tokens": max_tokens})
        return uid

    def remove(self, uids: list[int], return_caches: bool = False) -> dict[int, CacheAndTokens]:
        self.link.send({"op": "remove", "uids": uids, "caches": return_caches})
        out = self.inner.remove(uids, return_caches)
        self._origin.update({id(c): uid for uid, (c, _) in out.items()})
        return out

    def extract_cache(self, uids: list[int]) -> dict[int, CacheAndTokens]:
        self.link.send({"op": "extract", "uids": uids})
        out = self.inner.extract_cache(uids)
        self._origin.update({id(c): uid for uid, (c, _) in out.items()})
        return out

    def set_prefill_chunk(self, tokens: int) -> None:
        self.link.send({"op": "chunk", "tokens": tokens})
        self.inner.set_prefill_chunk(tokens)

    def cache_nbytes(self) -> int:
        return self.inner.cache_nbytes()

    def reset(self) -> None:
        with contextlib.suppress(GroupBroken):  # a broken group has nothing to reset
            self.link.send({"op": "reset"})
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


class MirroredPrefixCache(PrefixCache):
    """Rank 0's prefix cache; each fetch and insert is replayed on every follower's
    cache of its own KV shards, so all ranks resume a prompt from the same prefix."""

    def __init__(self, max_bytes: int, link: GroupLink, decoder: GroupDecoder,
                 identity: str = "") -> None:
        super().__init__(max_bytes, identity=identity)
        self.link = link
        self.decoder = decoder

    def fetch(self, tokens: list[int], namespace: str | None = None
              ) -> tuple[list[Any] | None, int]:
        if self.max_bytes > 0 and len(tokens) >= 2:
            self.link.send({"op": "pc_fetch", "tokens": list(tokens), "ns": namespace})
        return super().fetch(tokens, namespace)

    def insert(self, tokens: list[int], cache: list[Any], namespace: str | None = None) -> None:
        uid = self.decoder.origin(cache)
        if uid is None or self.max_bytes <= 0 or not tokens:
            return  # a KV state the followers cannot name is not cached on any rank
        self.link.send({"op": "pc_insert", "uid": uid, "tokens": list(tokens), "ns": namespace})
        super().insert(tokens, cache, namespace)

    def pin_prompt(self, tokens: list[int], marks: tuple[tuple[int, float], ...],
                   key: str | None, namespace: str | None = None) -> None:
        """Pins are not mirrored: a pinned state on rank 0 alone would resume the ranks
        from different prefixes, so a sharded model keeps the plain LRU."""

    def clear(self) -> None:
        self.link.send({"op": "pc_clear"})
        super().clear()


class ShardedLanguageModel(MLXLanguageModel):
    """A text model split over the ranks of an ``mx.distributed`` group (rank 0)."""

    # A host sgemv (``cpu_gemv``) evaluates the graph in the middle of a forward; in a
    # group whose forward holds collectives, the ranks then stopped answering (the
    # group's tests timed out at start-up), so sharded models keep MLX's matmuls.
    HOST_GEMV = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        group = self.options.group
        if group is None:
            raise ModelLoadError(self.name, "a sharded model needs --hosts")
        self.group_options: GroupOptions = group
        self.group: Any = None
        self.link: GroupLink | None = None
        self.mode = ""
        self._waiters: list[Reply[str]] = []  # one per running generate: the failure

    def load(self) -> None:
        if self.options.kv_bits is not None:  # the followers' batches keep full precision
            raise ModelLoadError(self.name, "--kv-bits is not supported for a model sharded "
                                            "over --hosts; serve it without quantized KV")
        opts = self.group_options
        self.group = join_group(opts.backend)
        link = GroupLink(opts, self.group.size())
        self.link = link
        try:
            link.connect(CONNECT_DEADLINE_S)
            link.on_failure(self._on_group_failure)
            link.send({"op": "load", "path": str(self.path),
                       "max_num_seqs": self.options.max_num_seqs,
                       "prefill_step_size": self._prefill_step(),
                       "prefix_cache_bytes": self.options.prefix_cache_bytes})
            super().load()
            link.wait_acks("loaded", LOAD_DEADLINE_S)
        except GroupBroken as e:
            link.close()
            raise ModelLoadError(self.name, f"the sharded group failed: {e}") from e

    def _load_model(self) -> tuple[Any, Any, dict[str, Any]]:
        model, tokenizer, config, self.mode = load_shard(str(self.path), self.group)
        return model, tokenizer, config

    def _scheduler(self, model: Any, probe_cache: list[Any]) -> SchedulerBase:
        opts, link = self.options, self.link
        assert link is not None
        if not all(hasattr(c, "merge") for c in probe_cache):
            raise ModelLoadError(self.name, "sharded serving needs a batchable KV cache")
        eos = sorted(self.tokenizer.eos_token_ids)
        link.send({"op": "decoder", "eos": eos})
        step = self._prefill_step()
        decoder = GroupDecoder(LMBatchDecoder(model, eos_ids=eos, max_num_seqs=opts.max_num_seqs,
                                              prefill_step_size=step),
                               link, self.group)
        self.prefix_cache = MirroredPrefixCache(opts.prefix_cache_bytes, link, decoder,
                                                identity=model_identity(self.path))
        return BatchScheduler(decoder, self.tokenizer, max_num_seqs=opts.max_num_seqs,
                              max_queue=opts.max_queue, prefill_step_size=step,
                              prefix_cache=self.prefix_cache, wake=self.worker.wake)

    def _prefill_step(self) -> int:
        """Prompt tokens per prefill step, as one process uses (shorter chunks on CPU)."""
        return cpu_prefill_chunk(self.options.prefill_step_size)

    def _on_group_failure(self, reason: str) -> None:
        """A rank died: the model is broken (new requests 503, /health unhealthy) and
        every request waiting on it gets a 503 now, not after a collective returns."""
        self.worker.death = f"sharded group broken: {reason}"
        send_all((waiter, reason) for waiter in list(self._waiters))

    async def generate(self, prepared: PreparedPrompt, seed_offset: int = 0
                       ) -> AsyncIterator[Event]:
        """``MLXLanguageModel.generate``, ended with a 503 when the group breaks."""
        link = self.link
        if link is None or link.failed is not None:
            raise _group_unavailable(link.failed if link and link.failed else "not loaded")
        waiter: Reply[str] = Reply()
        self._waiters.append(waiter)
        failed = asyncio.ensure_future(waiter)
        events = cast(AsyncGenerator[Event, None], super().generate(prepared, seed_offset))
        try:
            while True:
                step: asyncio.Future[Event] = asyncio.ensure_future(events.__anext__())
                await asyncio.wait([cast(asyncio.Future[Any], step), failed],
                                   return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
                    raise _group_unavailable(failed.result())
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                yield event
        finally:
            self._waiters.remove(waiter)
            failed.cancel()
            await events.aclose()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["group"] = self.group_info()
        return out

    def group_info(self) -> dict[str, Any]:
        """Size, backend, split and each rank's memory (for /v1/models and /metrics)."""
        link = self.link
        ranks = [{"rank": 0, "memory_bytes": self.memory_bytes()}]
        ranks += link.info() if link else []
        return {"size": self.group.size() if self.group else 0,
                "backend": self.group_options.backend, "split": self.mode,
                "healthy": link is not None and link.failed is None,
                "error": link.failed if link else None, "ranks": ranks}

    def stats(self) -> EngineStats:
        link = self.link
        ranks = [RankMemory(0, self.memory_bytes())]
        ranks += [RankMemory(r["rank"], r["memory_bytes"]) for r in (link.info() if link else [])]
        group = GroupStats(size=self.group.size() if self.group else 0,
                           backend=self.group_options.backend, split=self.mode,
                           healthy=link is not None and link.failed is None,
                           error=link.failed if link else None, ranks=tuple(ranks))
        return replace(super().stats(), group=group)

    def close(self) -> None:
        link = self.link
        if link is not None and link.failed is None:
            with contextlib.suppress(GroupBroken):
                link.send({"op": "unload"})
        super().close()
        if link is not None:
            link.close()


def _group_unavailable(reason: str) -> Overloaded:
    return Overloaded(f"The sharded model's group is broken: {reason}. Restart the group.",
                      retry_after=5, code="group_unhealthy")
