"""`mlxd serve --log-format json --drain-timeout`: SIGTERM lets an in-flight stream finish,
then the server exits 0; every log line is one JSON object, the request's among them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.server import free_port

# mlxd's text format ("2026-... INFO mlxd: ...") and uvicorn's own ("INFO:     ...")
TEXT_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \S+ |)(DEBUG|INFO|WARNING|ERROR):? ", re.M)


def _wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready line is printed once serving
        if line.startswith("mlxd ready"):
            return
    raise AssertionError(f"the server did not come up (exit {proc.wait()})")


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
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Request-Id": "drain-1"}) as resp:
            assert resp.headers["x-request-id"] == "drain-1"
            stream = resp.iter_lines()
            lines.append(next(stream))  # the stream is in flight
            proc.send_signal(signal.SIGTERM)
            lines.extend(stream)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"  # finished, not cut off
        assert any('"finish_reason": "' in d or '"finish_reason":"' in d for d in data)
        # console messages (BLAS, "preparing") are not log records; no record is text
        assert not TEXT_LOG.search(stderr), stderr
        records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's too
        request = next(r for r in records if r.get("request_id") == "drain-1")
        assert request["status"] == 200 and request["model"] == "tiny"
        assert request["completion_tokens"] > 0 and request["route"] == "/v1/chat/completions"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
