"""Concurrent conversations sharing a system prompt: the first prefills it, the others
wait for its state in the prefix cache and resume from it (engines/text/shared_prefix.py),
with the same greedy tokens as cold runs; on an attention model and a hybrid one."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import ServerConfig
from mlxd.engines.text.shared_prefix import common_prefix
from mlxd.generation.events import Finish, TextDelta
from mlxd.generation.params import GenerationRequest, SamplingParams
from tests.helpers.server import running_server
from tests.helpers.tiny_hybrids import build_hybrid

SYSTEM = "You are a coding agent. " + " ".join(
    f"Rule {i}: read file number {i} before editing it." for i in range(40))
TASKS = ("Rename the parser's helper.", "Fix the lexer's unicode bug.",
         "List the files that import the tokenizer.")
GATE_TIMEOUT = 120


@pytest.fixture(scope="module", params=["attention", "hybrid"])
def engine(request: pytest.FixtureRequest, tiny_model: Path, session_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tiny_model
    if request.param == "hybrid":
        folder = session_dir / "tiny-qwen3_5"
        if not (folder / "config.json").exists():
            build_hybrid(folder, "qwen3_5", tiny_model)
    cfg = ServerConfig(model=str(folder), served_model_name="m", no_starter=True,
                       home=tmp_path_factory.mktemp("shared-prefix-home"),
                       prefix_cache_bytes=64 * 2**20, max_num_seqs=4)
    with running_server(cfg) as srv, srv.client() as http:
        r = http.post("/v1/completions", json={"model": "m", "prompt": "warm up",
                                                "max_tokens": 2})
        assert r.status_code == 200, r.text  # the model is loaded
        yield srv.ctx.manager.get("m").engine


def _run_together(engine: Any, requests: list[GenerationRequest]) -> list[tuple[str, Finish]]:
    """Submit every request while the worker is held, so all are queued at its next step."""
    from mlxd.engines.text.scheduler import AsyncQueueSink, Sequence

    async def main() -> list[tuple[str, Finish]]:
        prepared = [await engine.prepare(r) for r in requests]
        started, gate = threading.Event(), threading.Event()

        def hold() -> None:
            started.set()
            gate.wait(GATE_TIMEOUT)

        engine.worker.submit(hold)
        assert started.wait(GATE_TIMEOUT)
        sinks = []
        for p in prepared:
            sink = AsyncQueueSink(asyncio.get_running_loop())
            engine.scheduler.submit(Sequence(
                seq_id=uuid.uuid4().hex, prompt=p, max_tokens=8,
                sampling=SamplingParams(temperature=0), stop_token_ids=p.stop_token_ids,
                pipeline=engine._pipeline(p), sink=sink))
            sinks.append(sink)
        gate.set()
        out = []
        for sink in sinks:
            events: list[Any] = []
            while not events or not isinstance(events[-1], Finish):
                events += await sink.channel.receive()
            out.append(("".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]))
        return out

    return asyncio.run(main())


def _request(task: str, salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
        max_tokens=8, sampling=SamplingParams(temperature=0), cache_salt=salt)


def test_concurrent_sessions_prefill_the_shared_system_prompt_once(engine: Any) -> None:
    salt = uuid.uuid4().hex  # a namespace of this test's own: nothing cached yet
    together = _run_together(engine, [_request(t, salt) for t in TASKS])
    prompts = [asyncio.run(engine.prepare(_request(t))).tokens for t in TASKS]
    shared = common_prefix(prompts[0], prompts[1])
    cached = [f.usage.cached_tokens for _, f in together]
    assert cached[0] == 0
    for n in cached[1:]:  # the system prompt, from the first prompt's prefill
        assert shared - 16 <= n <= shared, (cached, shared)
    # the same greedy answers as each prompt alone, cold
    cold = [_run_together(engine, [_request(t, uuid.uuid4().hex)])[0] for t in TASKS]
    assert [f.usage.cached_tokens for _, f in cold] == [0, 0, 0]
    assert [text for text, _ in together] == [text for text, _ in cold]
    assert [f.usage.completion_tokens for _, f in together] == \
        [f.usage.completion_tokens for _, f in cold]


def test_common_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix(list(range(1000)), [*range(517), -1]) == 517
    assert common_prefix([5], [6]) == 0
