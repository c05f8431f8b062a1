"""`mlxd serve --log-format json --drain-timeout`: on SIGTERM the server keeps accepting but
answers new requests 503 + Retry-After in their API's error shape (and /health "draining"),
lets an in-flight stream finish, then exits 0; every log line is one JSON object, the
request's among them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from mlxd.config import ServerConfig
from mlxd.server.connections import guarded_server
from mlxd.server.drain import Drain
from tests.helpers.server import free_port

# mlxd's text format ("2026-... INFO mlxd: ...") and uvicorn's own ("INFO:     ...")
TEXT_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \S+ |)(DEBUG|INFO|WARNING|ERROR):? ", re.M)


def _wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready line is printed once serving
        if line.startswith("mlxd ready"):
            return
    raise AssertionError(f"the server did not come up (exit {proc.wait()})")


def _start_held_request(port: int, body: bytes) -> socket.socket:
    """Send a request's head with ``Expect: 100-continue`` and wait for the "100 Continue":
    uvicorn sends it when the app first reads the body, so the request is then in flight
    (inside the server's middleware) until the body is sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nX-Request-Id: drain-1\r\n"
                 b"Expect: 100-continue\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before 100 Continue"
        got += chunk
    assert got.startswith(b"HTTP/1.1 100 "), got
    return sock


def _read_response(sock: socket.socket) -> tuple[str, str]:
    """The rest of a ``Connection: close`` response: (head, de-chunked body)."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:  # chunked transfer encoding: "<hex size>\r\n<data>\r\n", ending with 0
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2:]
    return head.decode("latin-1"), body.decode()


def _wait_draining(url: str) -> httpx.Response:
    deadline = time.monotonic() + 60  # generous: the signal is handled on the next loop turn
    while True:
        health = httpx.get(url + "/health", timeout=30)
        if health.json()["status"] == "draining" or time.monotonic() > deadline:
            return health


def test_sigterm_drains_a_stream_and_logs_json(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLXD_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", str(tiny_model), "--served-model-name", "tiny",
         "--no-starter", "--port", str(port), "--log-format", "json", "--drain-timeout", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc, url)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 300, "temperature": 0, "stream": True}
        payload = json.dumps(body).encode()
        held = _start_held_request(port, payload)  # in flight from here on
        proc.send_signal(signal.SIGTERM)
        # still accepting: health says draining (503) so load balancers take it out
        health = _wait_draining(url)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        # new requests: 503 + Retry-After in each API's error shape
        chat = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False},
                          timeout=30)
        assert chat.status_code == 503 and int(chat.headers["retry-after"]) >= 1
        assert chat.json()["error"]["type"] == "overloaded_error"
        assert chat.json()["error"]["code"] == "shutting_down"
        messages = httpx.post(url + "/v1/messages", timeout=30, json={
            "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 503 and "retry-after" in messages.headers
        assert messages.json()["type"] == "error"
        assert messages.json()["error"]["type"] == "overloaded_error"
        # the in-flight request runs to completion
        held.sendall(payload)
        head, text = _read_response(held)
        held.close()
        assert head.startswith("HTTP/1.1 200"), head
        assert "x-request-id: drain-1" in head.lower()
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        data = [line for line in text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"  # finished, not cut off
        assert any('"finish_reason": "' in d or '"finish_reason":"' in d for d in data)
        # console messages (BLAS, "preparing") are not log records; no record is text
        assert not TEXT_LOG.search(stderr), stderr
        records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's too
        request = next(r for r in records if r.get("request_id") == "drain-1")
        assert request["status"] == 200 and request["model"] == "tiny"
        assert request["completion_tokens"] > 0 and request["route"] == "/v1/chat/completions"
        refused = [r for r in records if r.get("route") == "/v1/messages"]
        assert refused and refused[0]["status"] == 503  # refusals are logged and counted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_signals_drain_then_a_second_one_forces_exit(tmp_path: Path) -> None:
    """The first signal only starts the drain; the loop ends it once nothing is in flight
    (here: after the one request), and a second signal skips the wait (force exit)."""
    app = FastAPI()
    app.state.ctx = SimpleNamespace(drain=Drain())
    server = guarded_server(app, ServerConfig(home=tmp_path), timeout_graceful_shutdown=60)
    server.started = True
    app.state.ctx.drain.in_flight = 1
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.ctx.drain.draining and not server.should_exit
    assert not asyncio.run(server.on_tick(1))  # a request is still in flight
    app.state.ctx.drain.in_flight = 0
    assert asyncio.run(server.on_tick(2)) and not server.force_exit  # drained: shut down
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit

    again = guarded_server(app, ServerConfig(home=tmp_path), timeout_graceful_shutdown=60)
    again.started = True
    app.state.ctx = SimpleNamespace(drain=Drain(in_flight=1))
    again.handle_exit(signal.SIGTERM, None)
    again.handle_exit(signal.SIGTERM, None)  # a second SIGTERM while draining
    assert again.should_exit and again.force_exit


DRAIN_S = 2.0
# After --drain-timeout: CUT_OFF_GRACE_S (3 s) for the 503s, then the engines close in
# parallel, each after its step or audio window in progress: at most 8 s to save state
# and 13 s to close (ModelManager.shutdown), documented as 25 s. Measured here on 2 busy
# cores: 10-25 s (an encoder batch under contention is the long pole).
EXIT_BOUND_S = 30.0


def test_work_cut_off_by_shutdown_gets_503s_and_error_events(
        smollm2: Path, test_home: Path, tmp_path: Path) -> None:
    """SIGTERM with four requests of different kinds running past --drain-timeout: each
    ends in its API's shape (503 error objects, an Anthropic error event on the stream),
    nothing logs "Exception in ASGI application", and the process exits in bounded time."""
    pytest.importorskip("mlx_whisper", reason="mlx-whisper is in the `audio` extra")
    from mlxd.models.spec import ModelEntry
    from mlxd.models.starter import STARTER_EMBEDDING, STARTER_STT
    from tests.helpers.audio import wav
    from tests.helpers.retrieval import registry_config

    entries = [ModelEntry(name="chat", source=str(smollm2)), STARTER_EMBEDDING.model_copy(),
               STARTER_STT.model_copy()]
    config = registry_config(tmp_path / "models.yaml", entries, test_home)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLXD_HOME": str(test_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--models-config", str(config.models_config),
         "--port", str(port), "--drain-timeout", str(DRAIN_S), "--encoder-batch-tokens", "2048"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results: dict[str, httpx.Response] = {}
    stream_lines: list[str] = []
    streaming = threading.Event()

    def post(name: str, path: str, **kw: Any) -> None:
        results[name] = httpx.post(url + path, timeout=120, **kw)

    def stream() -> None:
        body = {"model": "chat", "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=120) as r:
            results["stream"] = r
            for line in r.iter_lines():
                stream_lines.append(line)
                streaming.set()

    try:
        _wait_ready(proc, url)
        for name in ("chat", STARTER_EMBEDDING.name, STARTER_STT.name):
            assert httpx.post(url + "/v1/models/load", json={"model": name},
                              timeout=300).status_code == 200
        noise = np.random.default_rng(0).uniform(-0.5, 0.5, 1800 * 200)
        threads = [
            threading.Thread(target=post, args=("chat", "/v1/chat/completions"), kwargs={
                "json": {"model": "chat", "max_tokens": 2000,
                         "messages": [{"role": "user", "content": "Count to a thousand."}]}}),
            threading.Thread(target=post, args=("embeddings", "/v1/embeddings"), kwargs={
                "json": {"model": STARTER_EMBEDDING.name,
                         "input": [[101, *range(2000, 2254), 102]] * 2000}}),
            threading.Thread(target=post, args=("transcription", "/v1/audio/transcriptions"),
                             kwargs={"data": {"model": STARTER_STT.name},
                                     "files": {"file": ("long.wav", wav(noise, 200))}}),
            threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert streaming.wait(120), "the stream never started"
        time.sleep(2)  # the others' bodies are read and their work queued (not a sync point)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(120)
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    (tmp_path / "serve.err").write_text(stderr)  # kept for a failure's post-mortem
    assert proc.returncode == 0, stderr[-3000:]
    assert took < DRAIN_S + EXIT_BOUND_S, (took, stderr[-4000:])
    for name in ("chat", "embeddings", "transcription"):
        r = results[name]
        assert r.status_code == 503, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "shutting_down"
        assert r.json()["error"]["type"] == "overloaded_error"
    assert results["stream"].status_code == 200
    events = [line for line in stream_lines if line]
    assert events[-2] == "event: error", events[-4:]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["type"] == "error" and last["error"]["type"] == "overloaded_error"
    assert "Exception in ASGI application" not in stderr and "CancelledError" not in stderr
