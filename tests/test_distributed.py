"""One model sharded over two ranks on 127.0.0.1 (ring backend, started by mlx.launch).

Rank 0 serves HTTP and schedules; rank 1 replays each decoder call on its half
of every layer. Outputs are compared with the same model in one process
(``tiny_server``). The failure test runs last: it breaks the group.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.group import RunningGroup, running_group
from tests.helpers.server import RunningServer

pytestmark = pytest.mark.slow

GROUP_TIMEOUT_S = 3.0
PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def ", "for i in range("]
LONG = ("The quick brown fox jumps over the lazy dog while the compiler reads every line "
        "of the standard library twice, slowly, and writes its notes in the margin. ") * 2


@pytest.fixture(scope="module")
def group(tiny_model: Path, test_home: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningGroup]:
    log = tmp_path_factory.mktemp("group") / "group.log"
    with running_group(tiny_model, test_home, log, group_timeout=GROUP_TIMEOUT_S) as g:
        yield g


def test_the_memory_budget_counts_one_rank_share(tiny_model: Path, test_home: Path) -> None:
    from mlxd.config import ServerConfig
    from mlxd.models.catalog import build_catalog

    def estimate(**kw: Any) -> tuple[int, int]:
        cfg = ServerConfig(model=str(tiny_model), home=test_home, no_starter=True,
                           prefix_cache_bytes=1000, **kw)
        reg = build_catalog(cfg).registrations[0]
        assert reg.entry.pinned == bool(kw)  # a group forms once: never unloaded when idle
        return reg.estimate, reg.reserve

    whole, whole_reserve = estimate()
    share, share_reserve = estimate(hosts="127.0.0.1,127.0.0.1")
    weights, share_weights = whole - whole_reserve, share - share_reserve
    assert share_weights == weights // 2
    assert share_reserve == (whole_reserve - 1000) // 2 + 1000  # each rank: a whole cache


def _complete(url: str, prompt: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_group_is_shown_in_models_and_metrics(group: RunningGroup) -> None:
    info = group.group()
    assert info["size"] == 2 and info["backend"] == "ring" and info["healthy"]
    assert info["split"] == "tensor"
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert all(r["memory_bytes"] > 0 for r in info["ranks"])
    text = httpx.get(group.url + "/metrics").text
    assert 'mlxd_group_size{backend="ring",model="tiny",split="tensor"} 2.0' in text
    assert 'mlxd_group_healthy{model="tiny"} 1.0' in text
    assert 'mlxd_group_rank_memory_bytes{model="tiny",rank="1"}' in text


def test_greedy_output_matches_one_process(group: RunningGroup,
                                           tiny_server: RunningServer) -> None:
    for prompt in PROMPTS[:2]:
        sharded = _complete(group.url, prompt)["choices"][0]["text"]
        single = _complete(tiny_server.url, prompt)["choices"][0]["text"]
        assert sharded == single


def _stream_texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Stream each prompt; each request starts once the one before has its first token,
    so the requests join the running batch at different steps."""
    texts = [""] * len(prompts)
    started = [threading.Event() for _ in prompts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        texts[i] += json.loads(line[6:])["choices"][0]["text"]
                        started[i].set()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            started[i].set()

    threads = []
    for i in range(len(prompts)):
        t = threading.Thread(target=run, args=(i,))
        t.start()
        threads.append(t)
        started[i].wait(120)
    for t in threads:
        t.join(120)
    assert not errors, errors
    return texts


def test_concurrent_requests_joining_at_different_times_match(
        group: RunningGroup, tiny_server: RunningServer) -> None:
    sharded = _stream_texts(group.url, PROMPTS, 24)
    single = _stream_texts(tiny_server.url, PROMPTS, 24)
    assert all(sharded)
    assert sharded == single


def test_prefix_cache_is_reused_on_every_rank(group: RunningGroup,
                                              tiny_server: RunningServer) -> None:
    first = _complete(group.url, LONG, 8)
    second = _complete(group.url, LONG, 8)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    expected = _complete(tiny_server.url, LONG, 8)["choices"][0]["text"]
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == expected


def test_json_schema_request_follows_the_schema(group: RunningGroup) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a number"}],
            "max_tokens": 40, "temperature": 0.8, "seed": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}}
    r = httpx.post(group.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["n"], int)
    else:  # cut off by max_tokens: still a prefix the grammar allows
        assert choice["message"]["content"].startswith("{")


def test_a_rank_that_stops_answering_fails_requests_with_503(group: RunningGroup) -> None:
    """SIGSTOP rank 1 (alive but silent, the case a collective would wait on forever):
    in-flight requests get 503 within the heartbeat deadline and /health reports the
    group unhealthy; then SIGKILL it and the group's launcher ends rank 0 too."""
    pid = group.group()["ranks"][1]["pid"]
    results: list[httpx.Response] = []

    def long_request() -> None:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        results.append(httpx.post(group.url + "/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for t in threads:
        t.start()
    _wait_running(group, 2)
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.join(60)
        waited = time.monotonic() - stopped_at
        assert [r.status_code for r in results] == [503, 503]
        assert all(r.json()["error"]["code"] == "group_unhealthy" for r in results)
        assert waited < GROUP_TIMEOUT_S + 30  # the deadline, plus a loaded machine's slack
        health = httpx.get(group.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "rank 1" in json.dumps(health.json()["unhealthy"])
        refused = httpx.post(group.url + "/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503
    finally:
        os.kill(pid, signal.SIGKILL)
    group.proc.wait(60)  # mlx.launch ends the group once a rank died: nothing hangs


def _wait_running(group: RunningGroup, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(group.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith('mlxd_requests_running{model="tiny"}') and \
                    float(line.split()[-1]) >= n:
                return
        time.sleep(0.05)  # polling a gauge
    raise TimeoutError("the requests never ran")


FAKE_FOLLOWER = """
import os, socket, sys, time
from mlxd.runtime.distributed import send_frame
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
send_frame(sock, {"op": "hello", "rank": 1, "pid": os.getpid()})
while True:
    send_frame(sock, {"op": "beat", "memory_bytes": 1})
    time.sleep(0.2)
"""


def test_the_control_channel_notices_a_killed_rank_at_once() -> None:
    """No MLX here: a process speaking the follower's side of the channel is SIGKILLed,
    and rank 0's link reports the group broken without waiting for the heartbeat
    deadline (a closed connection is a dead rank)."""
    import subprocess
    import sys

    from mlxd.runtime.distributed import GroupOptions
    from mlxd.runtime.distributed_link import GroupBroken, GroupLink
    from tests.helpers.server import free_port

    port = free_port()
    link = GroupLink(GroupOptions("ring", port, timeout=60.0), size=2)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_FOLLOWER, str(port)])
    broken = threading.Event()
    reasons: list[str] = []
    try:
        link.connect(deadline_s=60)
        link.on_failure(lambda reason: (reasons.append(reason), broken.set()))
        assert link.info()[0]["pid"] == proc.pid
        proc.kill()
        assert broken.wait(10), "a killed rank went unnoticed"
        assert "closed its connection" in reasons[0] or "connection failed" in reasons[0]
        with pytest.raises(GroupBroken):
            link.send({"op": "next"})
    finally:
        proc.kill()
        proc.wait()
        link.close()
