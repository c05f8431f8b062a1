"""The agent trace (issue 13): a deterministic generator of coding-agent sessions, its JSONL
form, and its replay, which must deliver exactly the recorded prompts to a real server."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from mlxd.benchmark.agent_trace import (
    RECORDED_DIGESTS,
    SOURCE_FILES,
    TraceSpec,
    anthropic_body,
    build_trace,
    read_source,
    rename,
)
from mlxd.benchmark.trace_io import (
    TraceFileError,
    TraceRequest,
    agent_requests,
    chat_messages,
    openai_tools,
    read_trace_file,
    to_chat,
    write_trace_file,
)
from mlxd.benchmark.trace_replay import TraceTarget, replay
from mlxd.cli import main
from mlxd.protocol.anthropic import MessagesRequest
from mlxd.protocol.openai import ChatCompletionRequest
from tests.helpers.server import RunningServer

# Small enough for the tiny model's 2,048-token context and its locally trained tokenizer.
SMALL = TraceSpec(sessions=2, turns=3, files_per_session=1, tools=3, system_sections=2,
                  max_file_chars=1200, max_tokens=4)


def test_same_seed_same_requests_and_digest() -> None:
    a, b = build_trace(TraceSpec(sessions=2, turns=4)), build_trace(TraceSpec(sessions=2, turns=4))
    assert [s.turns for s in a.sessions] == [s.turns for s in b.sessions]
    assert a.digest() == b.digest()
    assert build_trace(TraceSpec(sessions=2, turns=4, seed=1)).digest() != a.digest()
    for path, sha in a.sources.items():  # what the tool_results hold, by file hash
        text = read_source(Path(path).stem, a.spec.max_file_chars)
        assert hashlib.sha256(text.encode()).hexdigest() == sha


def test_the_default_trace_is_the_recorded_one() -> None:
    trace = build_trace()
    if trace.python not in RECORDED_DIGESTS:
        pytest.skip(f"no recorded digest for Python {trace.python}")
    assert trace.digest() == RECORDED_DIGESTS[trace.python]


def _tool_pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(tool_use id, tool_result id of the next message) for every tool_use."""
    pairs = []
    for i, m in enumerate(messages):
        for block in m["content"] if isinstance(m["content"], list) else []:
            if block["type"] == "tool_use":
                results = [b["tool_use_id"] for b in messages[i + 1]["content"]
                           if b["type"] == "tool_result"]
                pairs.append((block["id"], results[0] if results else ""))
    return pairs


def test_sessions_have_the_documented_shape() -> None:
    trace = build_trace()
    assert len(trace.tools) == 12 and len(trace.system) > 3000
    assert {Path(p).stem for p in trace.sources} <= set(SOURCE_FILES)
    for s in trace.sessions:
        assert len(s.turns) == 8 and len(s.files) == 2
        for k, messages in enumerate(s.turns):
            body = anthropic_body(trace, s.index, k, "m")
            MessagesRequest.model_validate(body)  # Anthropic-valid
            ChatCompletionRequest.model_validate(to_chat(body))  # and as OpenAI chat
            roles = [m["role"] for m in messages]
            assert roles[0] == roles[-1] == "user"
            assert all(a != b for a, b in itertools.pairwise(roles))
            assert all(use == result for use, result in _tool_pairs(messages))
            if k:  # the history grows: the previous request is a prefix of this one
                assert messages[:len(s.turns[k - 1])] == s.turns[k - 1]
        reads = [b for m in s.turns[-1] if isinstance(m["content"], list)
                 for b in m["content"] if b["type"] == "tool_result"]
        assert len(reads) == 2
        for block in reads:
            assert 4000 < len(block["content"]) <= 8000  # about 1-2k tokens of Python
        for k, edit in enumerate(s.edits[:-1]):
            # the recorded answer holds the edit, which parses and renames only ``old``
            answer = s.turns[k + 1][len(s.turns[k])]["content"]
            assert edit.after.rstrip() in answer and edit.old != edit.new
            ast.parse(edit.after)
            assert edit.after.replace(edit.new, edit.old) == edit.before
            assert edit.new in edit.after and edit.qual.split(".")[-1] in edit.after


def test_rename_keeps_attributes_and_call_keywords() -> None:
    src = "def f(name, n=1):\n    x.name = name\n    return g(name=name, k=n)\n"
    assert rename(src, "name", "label") == (
        "def f(label, n=1):\n    x.name = label\n    return g(name=label, k=n)\n")


def test_trace_file_round_trip_and_bad_lines(tmp_path: Path) -> None:
    sessions = agent_requests(build_trace(SMALL), "m")
    path = tmp_path / "trace.jsonl"
    write_trace_file(path, sessions)
    assert read_trace_file(path) == sessions
    bare = tmp_path / "bare.jsonl"  # a proxy log: one request body per line, no session
    lines = [json.dumps(sessions[0][0].body),
             json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})]
    bare.write_text("\n".join(lines) + "\n\n")
    (only,) = read_trace_file(bare)
    assert [r.api for r in only] == ["messages", "chat"]
    for text, where in (("{not json", ":1: not JSON"), ('{"messages": 3}', "'messages' list"),
                        ('{"api": "x", "messages": []}', "api must be"),
                        ('{"system": "s", "messages": []}', "integer max_tokens"), ("", "no req")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(TraceFileError, match=where):
            read_trace_file(bad)


def _tokenize(srv: RunningServer, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> int:
    body: dict[str, Any] = {"model": "tiny", "messages": messages}
    if tools:
        body["tools"] = tools
    with srv.client() as c:
        resp = c.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["count"])


@pytest.mark.parametrize("api,tools_in_system", [("messages", False), ("messages", True),
                                                 ("chat", False), ("chat", True)])
def test_replay_delivers_the_recorded_prompts(tiny_server: RunningServer, api: str,
                                              tools_in_system: bool) -> None:
    trace = build_trace(SMALL)
    sessions = agent_requests(trace, "tiny")
    target = TraceTarget(url=tiny_server.url, model="tiny", api=api,  # type: ignore[arg-type]
                         tools_in_system=tools_in_system)
    results = asyncio.run(replay(target, sessions, timeout=60.0))
    assert all(s.ok for s in results)
    for session, done in zip(sessions, results, strict=True):
        assert len(done.results) == len(session)
        for req, r in zip(session, done.results, strict=True):
            tools = None if tools_in_system else openai_tools(req.body["tools"])
            expected = _tokenize(tiny_server, chat_messages(req.body, tools_in_system), tools)
            assert r.prompt_tokens == expected
            assert r.output_tokens >= 1 and r.ttft is not None
    # The history only grows, so the server's prefix cache covers the previous turn.
    later = [r for s in results for r in s.results if r.turn > 1]
    assert all((r.cached_tokens or 0) > 0 for r in later)


def test_cli_replays_a_trace_file(tiny_server: RunningServer, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    assert main(["bench", "--write-trace", str(path), "--sessions", "1", "--turns", "2",
                 "--max-tokens", "3"]) == 0
    first = read_trace_file(path)
    assert len(first) == 1 and len(first[0]) == 2
    # The generated trace at full size does not fit the tiny model: replay a small one.
    write_trace_file(path, [agent_requests(build_trace(SMALL), "x")[0]])
    args = ["bench", "--url", tiny_server.url, "--model", "tiny", "--no-progress",
            "--timeout", "60"]
    assert main([*args, "--trace", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["sessions_ok"] == 1 and [t["turn"] for t in run["turns"]] == [1, 2, 3]
    assert run["turns"][2]["cached_tokens"] > 0 and run["session_wall_s"] > 0
    assert "| turn | ok | TTFT s |" in capsys.readouterr().out
    assert main([*args, "--trace", str(path), "--api", "completions"]) == 2
    assert main([*args, "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert main([*args, "--api", "messages"]) == 2


def test_a_chat_request_is_not_replayed_as_messages() -> None:
    from mlxd.benchmark.trace_replay import request_for

    req = TraceRequest("s", "chat", {"model": "m", "messages": []})
    with pytest.raises(ValueError, match="chat request"):
        request_for(TraceTarget(url="http://127.0.0.1:1", model="m"), req)
