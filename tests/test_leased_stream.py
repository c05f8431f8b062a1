"""Every streamed response goes through one wrapper (``server/leased_stream.py``): a
failure after the status was sent reaches the client as its API's own error event
(no internals leak), and the model's lease is released however the stream ended."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.generation.events import Event, TextDelta
from tests.helpers.scripted_engine import scripted_server
from tests.helpers.server import RunningServer

MODEL = "agent"
ASK = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def failing(agent_model: Path, test_home: Path) -> Iterator[RunningServer]:
    """A server whose model streams one piece of text, then fails (a fault no real input
    causes: the engine's generate is replaced once the model is loaded)."""
    with scripted_server(agent_model, test_home, MODEL,
                         enable_prefix_cache_persist=False) as (srv, _):
        _break_after_first_event(srv)
        yield srv


def _break_after_first_event(srv: RunningServer) -> None:
    with srv.client() as http:  # loads the model
        assert http.post("/api/generate", json={"model": MODEL}).status_code == 200
    engine = srv.ctx.manager.get(MODEL).engine

    async def generate(prepared: Any, seed_offset: int = 0) -> AsyncIterator[Event]:
        yield TextDelta("Hello")
        raise RuntimeError("the Metal device went away")

    engine.generate = generate  # type: ignore[union-attr]


def _lines(srv: RunningServer, path: str, body: dict[str, Any]) -> list[str]:
    with srv.client() as http:
        r = http.post(path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [line for line in r.text.splitlines() if line]


def _released(srv: RunningServer) -> bool:
    deadline = time.monotonic() + 10
    while srv.ctx.manager.get(MODEL).leases and time.monotonic() < deadline:
        time.sleep(0.01)
    return srv.ctx.manager.get(MODEL).leases == 0


def test_a_chat_stream_that_fails_ends_with_an_openai_error_chunk(failing: RunningServer) -> None:
    data = [json.loads(x[6:]) for x in _lines(failing, "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "stream": True}) if x.startswith("data: {")]
    assert data[-2]["choices"][0]["delta"] == {"content": "Hello"}
    assert data[-1] == {"error": {"message": "generation failed", "type": "server_error",
                                  "param": None, "code": "generation_failed"}}
    assert _released(failing)


def test_a_messages_stream_that_fails_ends_with_an_anthropic_error_event(
        failing: RunningServer) -> None:
    lines = _lines(failing, "/v1/messages", {"model": MODEL, "messages": ASK,
                                              "max_tokens": 16, "stream": True})
    assert lines[-2:] == ["event: error", 'data: {"type":"error","error":{'
                                         '"type":"api_error","message":"generation failed"}}']
    assert _released(failing)


def test_a_responses_stream_that_fails_ends_with_an_error_event(failing: RunningServer) -> None:
    lines = _lines(failing, "/v1/responses", {"model": MODEL, "input": "go", "stream": True})
    assert lines[-2] == "event: error"
    event = json.loads(lines[-1][6:])
    assert (event["type"], event["code"], event["message"]) == (
        "error", "generation_failed", "generation failed")
    assert _released(failing)


def test_an_ollama_stream_that_fails_ends_with_an_error_line(failing: RunningServer) -> None:
    lines = _lines(failing, "/api/chat", {"model": MODEL, "messages": ASK})
    assert json.loads(lines[-1]) == {"error": "generation failed"}
    assert _released(failing)


def test_the_failure_is_logged_not_sent(failing: RunningServer) -> None:
    with httpx.Client(base_url=failing.url) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "go", "stream": True},
                      timeout=60)
    assert r.status_code == 200 and "Metal" not in r.text
    assert '"code":"generation_failed"' in r.text
    assert _released(failing)
