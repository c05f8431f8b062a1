"""A client that disconnects mid-stream stops its generation at the next step."""

from __future__ import annotations

import time

import httpx

from tests.helpers.server import RunningServer


def test_disconnect_mid_stream_removes_the_sequence(tiny_server: RunningServer) -> None:
    engine_stats = lambda: tiny_server.ctx.manager.get("tiny").engine.stats()  # noqa: E731
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 1900, "temperature": 0, "stream": True}
    with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            assert engine_stats().running == 1
    scheduler = tiny_server.ctx.manager.get("tiny").engine.scheduler
    steps_at_close = scheduler.steps
    deadline = time.monotonic() + 5
    while engine_stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_stats().running == 0
    # It stopped well before its 1,900 tokens.
    assert scheduler.steps - steps_at_close < 1500


def test_lease_is_released_after_a_disconnect(tiny_server: RunningServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 500, "stream": True}
    with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            next(r.iter_lines())
    res = tiny_server.ctx.manager.get("tiny")
    deadline = time.monotonic() + 5
    while res.leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert res.leases == 0
