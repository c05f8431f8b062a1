"""Continuous batching: equivalence, queueing, cancellation, isolation of failures."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.config import ServerConfig
from mlxd.generation.events import Finish, TextDelta
from mlxd.generation.params import GenerationRequest, SamplingParams
from tests.helpers.server import RunningServer, running_server

PROMPTS = [f"def function_{i}(x):\n    return" for i in range(8)]


def complete(http: httpx.Client, prompt: str, **kw: object) -> dict:
    r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 24,
                                           "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def batch_server(tiny_model_b: Path, test_home: Path) -> Iterator[RunningServer]:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=test_home,
                       no_starter=True, prefix_cache_bytes=0, max_num_seqs=8)
    with running_server(cfg) as srv:
        yield srv


def test_batched_results_equal_results_alone(batch_server: RunningServer) -> None:
    with batch_server.client() as http:
        alone = [complete(http, p)["choices"][0]["text"] for p in PROMPTS]
        with cf.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: complete(http, p)["choices"][0]["text"], PROMPTS))
        seeded = dict(temperature=0.9, seed=42)
        alone_seeded = complete(http, PROMPTS[0], **seeded)["choices"][0]["text"]
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, http, p, **seeded) for p in PROMPTS]
            batched_seeded = futures[0].result()["choices"][0]["text"]
    assert together == alone
    assert len(set(alone)) > 1  # a real test: the prompts give different outputs
    assert batched_seeded == alone_seeded
    assert batch_server.ctx.manager.get("m").engine.describe()["batching"] == "batched"


def test_requests_really_share_decode_steps(batch_server: RunningServer) -> None:
    scheduler = batch_server.ctx.manager.get("m").engine.scheduler
    with batch_server.client() as http:
        before = scheduler.steps
        complete(http, PROMPTS[0], max_tokens=40)
        single = scheduler.steps - before
        before = scheduler.steps
        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: complete(http, p, max_tokens=40), PROMPTS))
        eight = scheduler.steps - before
    assert eight < 3 * single  # 8 sequences of 40 tokens did not take 8x the steps


def test_full_queue_answers_503_with_retry_after(tiny_model_b: Path, test_home: Path) -> None:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=test_home,
                       no_starter=True, max_num_seqs=1, max_queue=1)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1900,
            "stream": True}
    with running_server(cfg) as srv, srv.client() as http:
        # Chat streams send their headers at once, so both are in the server now:
        # one running, one queued.
        with http.stream("POST", "/v1/chat/completions", json=body) as _first, \
                http.stream("POST", "/v1/chat/completions", json=body) as second:
            r = http.post("/v1/chat/completions", json={**body, "stream": False})
            assert r.status_code == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert "queue is full" in r.json()["error"]["message"]
            assert second.status_code == 200


def test_serial_mode_gives_the_same_answers(tiny_model_b: Path, test_home: Path,
                                            batch_server: RunningServer) -> None:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=test_home,
                       no_starter=True, batching=False)
    with batch_server.client() as http:
        batched = [complete(http, p)["choices"][0]["text"] for p in PROMPTS[:3]]
    with running_server(cfg) as srv, srv.client() as http:
        with cf.ThreadPoolExecutor(3) as pool:
            serial = list(pool.map(lambda p: complete(http, p)["choices"][0]["text"], PROMPTS[:3]))
        card = http.get("/v1/models/m").json()
        assert card["batching"] == "serial"
    assert serial == batched


def test_a_failing_request_does_not_end_the_others(batch_server: RunningServer) -> None:
    """A logits processor that raises (a fault injected on purpose: no HTTP request can
    cause one) fails only its own sequence; the rest of the batch goes on."""
    from mlxd.engines.text.scheduler import AsyncQueueSink, Sequence

    engine = batch_server.ctx.manager.get("m").engine

    def boom(tokens: object, logits: object) -> object:
        raise ValueError("broken processor")

    async def run_one(prompt: str, broken: bool) -> Finish:
        prepared = await engine.prepare(GenerationRequest(
            prompt=prompt, max_tokens=30, sampling=SamplingParams(temperature=0)))
        sink = AsyncQueueSink(asyncio.get_running_loop())
        engine.scheduler.submit(Sequence(
            seq_id=prompt, prompt=prepared, max_tokens=30,
            sampling=SamplingParams(temperature=0), stop_token_ids=prepared.stop_token_ids,
            pipeline=engine._pipeline(prepared), sink=sink,
            extra_processors=[boom] if broken else []))
        events: list = []
        while not events or not isinstance(events[-1], Finish):
            events += await sink.channel.receive()
        if not broken:
            assert sum(isinstance(e, TextDelta) for e in events) > 0
        return events[-1]

    async def main() -> list[Finish]:
        return await asyncio.gather(run_one(PROMPTS[0], False), run_one(PROMPTS[1], True),
                                    run_one(PROMPTS[2], False))

    finishes = asyncio.run(main())
    assert [f.reason for f in finishes] == ["length", "error", "length"]
    assert [f.usage.completion_tokens for f in finishes][::2] == [30, 30]
    assert "broken processor" in (finishes[1].error or "")
