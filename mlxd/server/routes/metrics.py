"""GET /metrics: Prometheus metrics (docs/metrics.md lists them all).

Model, memory and scheduler state are read from the live model manager at
scrape time; per-request series are recorded by ``server/observe.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mlxd.models.engine import EngineStats, GroupStats, KVStats, PrefixCacheStats
from mlxd.models.manager import ModelManager
from mlxd.models.residency import State
from mlxd.server.context import ServerContext, get_ctx

router = APIRouter()


class ManagerCollector:
    """Reads models, memory and scheduler state when Prometheus scrapes."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Any]:
        manager = self.manager
        yield GaugeMetricFamily("mlxd_memory_budget_bytes", "Configured memory budget",
                                value=manager.policy.budget_bytes)
        yield GaugeMetricFamily("mlxd_memory_used_bytes", "Bytes held against the budget",
                                value=manager.used_bytes())
        yield GaugeMetricFamily("mlxd_memory_transient_bytes", "Bytes requests hold outside "
                                "the models (decoded images, audio samples), in the budget",
                                value=manager.transient.held)
        yield CounterMetricFamily("mlxd_evictions", "Models evicted to make room",
                                  value=manager.evictions)
        state = GaugeMetricFamily("mlxd_model_state", "1 for the model's current state",
                                  labels=["model", "kind", "state"])
        memory = GaugeMetricFamily("mlxd_model_memory_bytes", "Model memory (estimate "
                                   "while unloaded)", labels=["model"])
        loads = CounterMetricFamily("mlxd_model_loads", "Times the model was loaded",
                                    labels=["model"])
        leases = GaugeMetricFamily("mlxd_model_leases", "Requests holding the model",
                                   labels=["model"])
        running = GaugeMetricFamily("mlxd_requests_running", "Sequences in the running batch",
                                    labels=["model"])
        waiting = GaugeMetricFamily("mlxd_requests_waiting", "Sequences queued",
                                    labels=["model"])
        cache = GaugeMetricFamily("mlxd_prefix_cache_bytes", "Prefix cache size",
                                  labels=["model"])
        hits = CounterMetricFamily("mlxd_prefix_cache_hits", "Prefix cache hits",
                                   labels=["model"])
        lookups = CounterMetricFamily("mlxd_prefix_cache_lookups", "Prefix cache lookups "
                                      "(one per admitted sequence)", labels=["model"])
        steps = CounterMetricFamily("mlxd_scheduler_steps", "Scheduler steps (one token for "
                                    "each running sequence)", labels=["model"])
        batch = HistogramMetricFamily("mlxd_batch_size", "Sequences in the batch, observed "
                                      "once per scheduler step", labels=["model"])
        drafts_ok = CounterMetricFamily("mlxd_speculative_accepted_tokens", "Draft tokens the "
                                        "model confirmed (speculative decoding)", labels=["model"])
        drafts_bad = CounterMetricFamily("mlxd_speculative_rejected_tokens", "Draft tokens the "
                                         "model refused (speculative decoding)", labels=["model"])
        disk_bytes = GaugeMetricFamily("mlxd_prefix_cache_disk_bytes", "Bytes the prefix "
                                       "cache's disk tier holds", labels=["model"])
        disk_reads = CounterMetricFamily("mlxd_prefix_cache_disk_reads", "Entries read back "
                                         "from the prefix cache's disk tier", labels=["model"])
        speech_batches = CounterMetricFamily("mlxd_speech_batches", "Batches a speech model "
                                             "ran (STT windows, TTS sentences)",
                                             labels=["model"])
        speech_shared = CounterMetricFamily("mlxd_speech_shared_batches", "Speech batches "
                                            "that held work of more than one request",
                                            labels=["model"])
        speech_items = CounterMetricFamily("mlxd_speech_batch_items", "STT windows or TTS "
                                           "sentences the speech batches held",
                                           labels=["model"])
        kv = _KVGauges()
        group = _GroupGauges()
        for res in manager.residencies():
            for s in State:
                state.add_metric([res.name, str(res.kind), str(s)], 1 if res.state == s else 0)
            memory.add_metric([res.name], res.memory_bytes())
            loads.add_metric([res.name], res.loads)
            leases.add_metric([res.name], res.leases)
            stats = res.stats() or EngineStats()
            running.add_metric([res.name], stats.running)
            waiting.add_metric([res.name], stats.waiting)
            prefix = stats.prefix_cache or PrefixCacheStats()
            cache.add_metric([res.name], prefix.nbytes)
            if prefix.disk_bytes is not None:
                disk_bytes.add_metric([res.name], prefix.disk_bytes)
                disk_reads.add_metric([res.name], prefix.disk_reads)
            hits.add_metric([res.name], prefix.hits)
            lookups.add_metric([res.name], prefix.hits + prefix.misses)
            sched = stats.scheduler
            if sched is not None:
                steps.add_metric([res.name], sched.steps)
                batch.add_metric([res.name], *_batch_buckets(sched.batch_sizes))
                if sched.draft is not None:
                    drafts_ok.add_metric([res.name], sched.draft[0])
                    drafts_bad.add_metric([res.name], sched.draft[1])
                if sched.kv is not None:
                    kv.add(res.name, sched.kv)
            if "shared_batches" in stats.counters:
                counters = stats.counters
                speech_batches.add_metric([res.name], counters.get("batches", 0))
                speech_shared.add_metric([res.name], counters["shared_batches"])
                speech_items.add_metric([res.name], counters.get(
                    "batched_windows", counters.get("batched_sentences", 0)))
            if stats.group is not None:
                group.add(res.name, stats.group)
        yield from (state, memory, loads, leases, running, waiting, cache, hits, lookups, steps,
                    batch, drafts_ok, drafts_bad, disk_bytes, disk_reads, speech_batches,
                    speech_shared, speech_items, *kv.families(),
                    *group.families())


class _KVGauges:
    """Admission by live KV (engines/text/kv_admission.py): what running sequences hold and are
    granted, the allowance, preemptions and sequences waiting for memory."""

    def __init__(self) -> None:
        self.live = GaugeMetricFamily("mlxd_kv_live_bytes", "KV bytes the running sequences "
                                      "hold", labels=["model"])
        self.granted = GaugeMetricFamily("mlxd_kv_granted_bytes", "KV bytes granted to the "
                                         "running sequences (what admission counts)",
                                         labels=["model"])
        self.peak = GaugeMetricFamily("mlxd_kv_peak_live_bytes", "Most KV bytes the running "
                                      "sequences held at once", labels=["model"])
        self.allowance = GaugeMetricFamily("mlxd_kv_allowance_bytes", "KV bytes the budget "
                                           "leaves the model (at the last check)",
                                           labels=["model"])
        self.preemptions = CounterMetricFamily("mlxd_kv_preemptions", "Sequences preempted "
                                               "to keep KV within the allowance",
                                               labels=["model"])
        self.waiting = GaugeMetricFamily("mlxd_kv_waiting_for_memory", "Queued sequences "
                                         "waiting for KV memory", labels=["model"])
        self.per_token = GaugeMetricFamily("mlxd_kv_bytes_per_token", "KV bytes one token "
                                           "takes (at --kv-bits when quantized)",
                                           labels=["model"])
        self.transient = GaugeMetricFamily("mlxd_kv_transient_reserve_bytes", "Bytes the "
                                           "budget reserves for what one step holds beyond "
                                           "the live KV (activations, logits, copies)",
                                           labels=["model"])

    def add(self, model: str, stats: KVStats) -> None:
        self.live.add_metric([model], stats.live_bytes)
        self.granted.add_metric([model], stats.granted_bytes)
        self.peak.add_metric([model], stats.peak_live_bytes)
        self.allowance.add_metric([model], stats.allowance_bytes)
        self.preemptions.add_metric([model], stats.preemptions)
        self.waiting.add_metric([model], stats.waiting_for_memory)
        self.per_token.add_metric([model], stats.bytes_per_token)
        self.transient.add_metric([model], stats.transient_bytes)

    def families(self) -> list[Any]:
        return [self.live, self.granted, self.peak, self.allowance, self.preemptions,
                self.waiting, self.per_token, self.transient]


class _GroupGauges:
    """A sharded model's group: its size and backend, health, and each rank's memory."""

    def __init__(self) -> None:
        self.size = GaugeMetricFamily("mlxd_group_size", "Ranks a sharded model is split over",
                                      labels=["model", "backend", "split"])
        self.healthy = GaugeMetricFamily("mlxd_group_healthy", "1 while every rank of the "
                                         "sharded model's group answers", labels=["model"])
        self.memory = GaugeMetricFamily("mlxd_group_rank_memory_bytes", "Memory each rank "
                                        "holds (rank 0: its model; others: MLX active "
                                        "memory)", labels=["model", "rank"])

    def add(self, model: str, group: GroupStats) -> None:
        self.size.add_metric([model, group.backend, group.split], group.size)
        self.healthy.add_metric([model], 1 if group.healthy else 0)
        for rank in group.ranks:
            self.memory.add_metric([model, str(rank.rank)], rank.memory_bytes)

    def families(self) -> list[Any]:
        return [self.size, self.healthy, self.memory]


def _batch_buckets(counts: Sequence[int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative power-of-two buckets (and the sum) from steps counted per batch size."""
    buckets: list[tuple[str, float]] = []
    bound, seen = 1, 0
    for size, n in enumerate(counts):
        while size > bound:
            buckets.append((str(bound), seen))
            bound *= 2
        seen += n
    buckets.append((str(bound), seen))
    buckets.append(("+Inf", seen))
    return buckets, float(sum(size * n for size, n in enumerate(counts)))


def metrics_registry(manager: ModelManager,
                     registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """One app's Prometheus registry: its own, so apps in one process never share metrics."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(ManagerCollector(manager))  # type: ignore[arg-type]
    return registry


@router.get("/metrics")
async def metrics(ctx: ServerContext = Depends(get_ctx)) -> Response:
    return Response(generate_latest(ctx.metrics), media_type=CONTENT_TYPE_LATEST)
