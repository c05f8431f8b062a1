"""Keep-alive while a long prompt is prefilled, in every streaming text API.

A tiny model with a long context prefills a long prompt for seconds before its first
token. Clients whose idle (read) timeout is shorter than that prefill must still get
their answer, because the server sends a keep-alive every ``keepalive_interval``:
an SSE comment on chat completions, a ``ping`` event on Anthropic Messages, a
repeated ``response.in_progress`` on Responses (the event Codex counts as activity).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.config import ServerConfig
from tests.helpers.agent_clients import build_long_model
from tests.helpers.server import RunningServer, running_server
from tests.helpers.tiny_models import _corpus

INTERVAL = 0.1  # seconds of silence before a keep-alive
PROMPT_CHARS = 36_000  # ~9k tokens: seconds of prefill for the tiny model on a CPU


@pytest.fixture(scope="module")
def long_server(session_dir: Path, test_home: Path) -> Iterator[RunningServer]:
    model = build_long_model(session_dir / "long-llama")
    cfg = ServerConfig(model=str(model), served_model_name="long", home=test_home,
                       no_starter=True, keepalive_interval=INTERVAL, prefix_cache_bytes=0,
                       enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


def long_prompt(seed: int) -> str:
    """A different long text per request, so no request reuses another's prefill."""
    text = "\n".join(_corpus(400_000))
    rng = random.Random(seed)
    at = rng.randrange(0, len(text) - PROMPT_CHARS)
    return f"{seed}: " + text[at:at + PROMPT_CHARS]


def sse_stream(srv: RunningServer, path: str, body: dict, idle: float) -> tuple[list[str], float]:
    """POST ``body`` and read the SSE stream with a read timeout of ``idle`` seconds:
    the non-empty lines, and the seconds until the first one carrying output."""
    started = time.monotonic()
    first = None
    lines = []
    timeout = httpx.Timeout(10.0, read=idle)
    with httpx.Client(base_url=srv.url, timeout=timeout) as http:
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if first is None and _content(line):
                    first = time.monotonic() - started
    assert first is not None, lines[-10:]
    return lines, first


def _content(line: str) -> bool:
    """A line carrying generated output (a delta of text, thinking or a tool call)."""
    return line.startswith("data:") and any(
        key in line for key in ('"content_block_delta"', '"response.output_text.delta"',
                                '"response.reasoning_text.delta"', '"delta":{"content"'))


@pytest.fixture(scope="module")
def idle_timeout(long_server: RunningServer) -> float:
    """A client idle timeout well under this machine's prefill of the long prompt
    (measured once, without a timeout, here)."""
    started = time.monotonic()
    body = {"model": "long", "messages": [{"role": "user", "content": long_prompt(0)}],
            "max_tokens": 1, "stream": False}
    with long_server.client(timeout=300) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prefill = time.monotonic() - started
    assert prefill > 8 * INTERVAL, f"prefill took {prefill:.2f}s: too short to test keep-alives"
    return max(prefill / 4, 2 * INTERVAL)


def test_chat_completions_sends_comments_while_prefilling(long_server: RunningServer,
                                                          idle_timeout: float) -> None:
    body = {"model": "long", "messages": [{"role": "user", "content": long_prompt(1)}],
            "max_tokens": 4, "stream": True}
    lines, first = sse_stream(long_server, "/v1/chat/completions", body, idle_timeout)
    assert first > idle_timeout  # the client would have timed out without keep-alives
    assert lines.count(": keep-alive") >= 2
    assert lines[-1] == "data: [DONE]"


def test_anthropic_messages_sends_pings_while_prefilling(long_server: RunningServer,
                                                         idle_timeout: float) -> None:
    body = {"model": "long", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": long_prompt(2)}]}
    lines, first = sse_stream(long_server, "/v1/messages", body, idle_timeout)
    assert first > idle_timeout
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("ping") >= 3  # the opening ping and keep-alives
    pings = [json.loads(line[5:]) for line in lines if line.startswith("data:")
             and '"type":"ping"' in line]
    assert all(p == {"type": "ping"} for p in pings)


def test_responses_repeats_in_progress_while_prefilling(long_server: RunningServer,
                                                        idle_timeout: float) -> None:
    body = {"model": "long", "input": long_prompt(3), "max_output_tokens": 4, "stream": True}
    lines, first = sse_stream(long_server, "/v1/responses", body, idle_timeout)
    assert first > idle_timeout
    data = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    kinds = [d["type"] for d in data]
    assert kinds.count("response.in_progress") >= 3
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert len({d["response"]["id"] for d in data if "response" in d}) == 1


def test_openai_sdk_reads_a_responses_stream_with_keepalives(long_server: RunningServer,
                                                             idle_timeout: float) -> None:
    """The SDK's stream accumulator accepts the repeated lifecycle events."""
    from openai import OpenAI

    client = OpenAI(base_url=long_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=idle_timeout)
    with client.responses.stream(model="long", input=long_prompt(4),
                                 max_output_tokens=4) as stream:
        kinds = [event.type for event in stream]
    assert kinds.count("response.in_progress") >= 3
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_a_disconnect_during_prefill_still_cancels(long_server: RunningServer,
                                                   idle_timeout: float) -> None:
    """Keep-alives do not keep a request alive once its client has gone: closing the
    stream at the first keep-alive stops the prefill well before it would finish (the
    prefill takes about four idle timeouts, see ``idle_timeout``)."""
    engine = long_server.ctx.manager.get("long").engine
    body = {"model": "long", "messages": [{"role": "user", "content": long_prompt(5)}],
            "max_tokens": 64, "stream": True}
    with httpx.Client(base_url=long_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            while next(lines) != ": keep-alive":
                pass
            busy = engine.stats()
            gone = time.monotonic()
    while engine.stats().running + engine.stats().waiting and \
            time.monotonic() - gone < 2 * idle_timeout:
        time.sleep(0.01)
    assert busy.running + busy.waiting == 1, busy  # it was being prefilled
    assert engine.stats().running + engine.stats().waiting == 0
    assert long_server.ctx.manager.get("long").leases == 0
