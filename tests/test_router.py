"""Two mlxd replicas behind LiteLLM's Router on 127.0.0.1 (docs/scaling.md).

mlxd gives the router a readiness and load report (/health: ``ready``,
``load``), keeps an agent's prefix cache warm for the replica its session is
pinned to (LiteLLM's ``session_affinity`` on ``metadata.session_id``), and on
SIGTERM drains: in-flight requests finish, new ones get 503, which the
router retries on the other replica. The replica-stopping test runs last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.router import (
    Replica,
    loopback_only,
    make_router,
    served_by,
    start_replica,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, test_home: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replicas")
    started = [start_replica(tiny_model, test_home, logs / f"r{i}.log", "--drain-timeout", "60")
               for i in range(2)]
    try:
        for r in started:
            wait_ready(r)
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture
def router(replicas: list[Replica]) -> Iterator[Any]:
    with loopback_only():
        yield make_router(replicas)


def _ask(router: Any, content: str, **kw: Any) -> Any:
    return router.acompletion(model="tiny", messages=[{"role": "user", "content": content}],
                              max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)


def test_health_reports_readiness_and_load(replicas: list[Replica]) -> None:
    health = replicas[0].health()
    assert health["ready"] is True and health["status"] == "ok"
    assert health["load"] == {"running": 0, "waiting": 0}


def test_requests_spread_across_both_replicas(router: Any, replicas: list[Replica]) -> None:
    async def run() -> list[Any]:
        return list(await asyncio.gather(*[_ask(router, f"hello {i}") for i in range(8)]))

    answered = [served_by(r) for r in asyncio.run(run())]
    assert set(answered) == {r.url for r in replicas}


def test_a_session_sticks_to_one_replica_and_reuses_its_cache(router: Any) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful coding agent. " * 6},
        {"role": "user", "content": "List the files in the repository."}]

    async def run() -> list[tuple[str, int]]:
        seen = []
        for turn in range(3):
            r = await router.acompletion(model="tiny", messages=messages, max_tokens=8,
                                         temperature=0, metadata={"session_id": "agent-1"})
            seen.append((served_by(r), r.usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            messages.append({"role": "user", "content": f"Now open file {turn}."})
        return seen

    seen = asyncio.run(run())
    assert len({url for url, _ in seen}) == 1
    cached = [c for _, c in seen]
    assert cached[1] > cached[0] and cached[2] > cached[1], cached


def test_stopping_a_replica_mid_load_loses_no_request(router: Any,
                                                      replicas: list[Replica]) -> None:
    """SIGTERM one replica while both decode: its in-flight requests finish (drain), the
    ones it refuses with 503 are retried by the router on the other; none fails."""
    leaving = replicas[1]

    async def run() -> list[Any]:
        # long enough answers that the replica is still decoding when the gauge is read
        # (48 tokens of the tiny model take ~70 ms, shorter than a poll)
        tasks = [asyncio.create_task(_ask(router, f"write a poem {i}", max_tokens=400,
                                          extra_body={"ignore_eos": True}))
                 for i in range(8)]
        await _until_running(leaving)
        leaving.terminate()
        tasks += [asyncio.create_task(_ask(router, f"and another {i}")) for i in range(6)]
        return list(await asyncio.gather(*tasks))

    results = asyncio.run(run())
    assert len(results) == 14
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    # what it was decoding when told to stop, it finished itself (the drain), not a retry
    assert any(served_by(r) == leaving.url for r in results)
    assert leaving.proc.wait(90) == 0  # drained and exited cleanly


async def _until_running(replica: Replica) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(1500):
            health = (await client.get(replica.url + "/health")).json()
            if health["load"]["running"] > 0:
                return
            await asyncio.sleep(0.02)  # polling a gauge
    raise TimeoutError("the replica never started decoding")
