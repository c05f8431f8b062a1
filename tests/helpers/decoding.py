"""Driving a ``Decoder`` directly, step by step, as the scheduler does."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from mlxd.engines.text.sampling import greedy


def run_jobs(decoder: Any, jobs: list[dict[str, Any]], eos: list[int],
             on_response: Callable[[int, Any], None] | None = None) -> list[list[int]]:
    """Each job's tokens through ``decoder`` until every job finishes.

    A job is ``{"tokens", "max"}`` plus optional ``join`` (the step it enters at),
    ``sampler``, ``procs`` and ``prompt`` (a prepared prompt, for decoders that read
    more than its tokens: images); ``on_response(job index, response)`` sees every response.
    """
    out: list[list[int]] = [[] for _ in jobs]
    waiting = list(enumerate(jobs))
    owner: dict[int, int] = {}
    done, step = 0, 0
    while done < len(jobs):
        for j, job in [w for w in waiting if w[1].get("join", 0) <= step]:
            prompt = job.get("prompt") or SimpleNamespace(tokens=job["tokens"])
            uid = decoder.insert(prompt, 0, None,
                                 job.get("sampler", greedy), job.get("procs", []), set(eos),
                                 job["max"])
            owner[uid] = j
            waiting.remove((j, job))
        _, responses = decoder.next()
        for r in responses:
            out[owner[r.uid]].append(r.token)
            if on_response is not None:
                on_response(owner[r.uid], r)
            done += r.finish_reason is not None
        step += 1
    return out
