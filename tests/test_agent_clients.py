"""The real coding agents against a real ``mlxd serve``: Claude Code 2.1.197 and Codex CLI
0.171.0, as pinned by ``make agents`` (tests/helpers/agent_clients.py).

* With their defaults (Claude Code's 24 tools and ~76 KB request; Codex's default
  configuration with a custom provider, ``wire_api = "responses"``) each runs to exit
  code 0 and the server answers every request with a 2xx. The model is a tiny
  random-weight Llama with a 64k context whose output layer ends every answer at once.
* Each completes a tool round trip: a tiny model trained at test time to answer with
  one fixed tool call in its template's format (``<tool_call>{...}</tool_call>``) makes
  Claude Code's Bash tool write a marker file and Codex's ``exec_command`` run ``echo``;
  each agent then sends the tool's result back and prints the model's final answer.

Each agent runs with a throwaway HOME (and CODEX_HOME), telemetry off.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.agent_clients import (
    MlxdServe,
    agent_binary,
    build_long_model,
    build_terse_model,
    build_tool_caller,
)

pytestmark = pytest.mark.slow

ANSWER = "The tool ran."
CALLS = {"Bash": {"name": "Bash", "arguments": {"command": "echo mlxd-ok > marker.txt"}},
         "exec_command": {"name": "exec_command", "arguments": {"cmd": "echo mlxd-ok"}}}
RUN_TIMEOUT = 240  # seconds per agent run: the default request's prefill is ~30 s on a CPU


@pytest.fixture(scope="module")
def claude() -> Path:
    return agent_binary("claude")


@pytest.fixture(scope="module")
def codex() -> Path:
    return agent_binary("codex")


def _serve(model: Path, home: Path, log: Path) -> Iterator[MlxdServe]:
    srv = MlxdServe(model, "tiny", home, log)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def default_server(session_dir: Path, test_home: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlxdServe]:
    """The long-context model that ends every answer at once, with the agents' own
    (full) chat template: their whole default requests are rendered."""
    model = build_terse_model(build_long_model(session_dir / "long-llama"),
                              session_dir / "long-llama-terse")
    yield from _serve(model, test_home, tmp_path_factory.mktemp("serve") / "mlxd.log")


@pytest.fixture(scope="module")
def tool_server(session_dir: Path, test_home: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlxdServe]:
    model = build_tool_caller(session_dir / "agent-tool-caller", CALLS, ANSWER)
    yield from _serve(model, test_home, tmp_path_factory.mktemp("serve") / "mlxd.log")


def run_claude(claude: Path, srv: MlxdServe, work: Path, *args: str) -> subprocess.CompletedProcess:
    home = work / "home"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": srv.name, "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200"}
    return subprocess.run([str(claude), "-p", "say hi", "--model", srv.name, *args],
                          cwd=work, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)


def run_codex(codex: Path, srv: MlxdServe, work: Path) -> subprocess.CompletedProcess:
    home = work / "home"
    (home / "codex").mkdir(parents=True)
    (home / "codex" / "config.toml").write_text(
        f'model = "{srv.name}"\nmodel_provider = "mlxd"\n\n[model_providers.mlxd]\n'
        f'name = "mlxd"\nbase_url = "{srv.url}/v1"\nwire_api = "responses"\n'
        'env_key = "MLXD_API_KEY"\n')
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "CODEX_HOME": str(home / "codex"), "MLXD_API_KEY": "unused"}
    return subprocess.run([str(codex), "exec", "--json", "--skip-git-repo-check",
                           "-s", "read-only", "say hi"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          stdin=subprocess.DEVNULL)


def assert_clean(srv: MlxdServe, since: int, route: str) -> list[dict]:
    """The requests since ``since``: some on ``route``, none answered 4xx/5xx."""
    requests = srv.requests()[since:]
    assert not srv.errors(since), srv.errors(since)
    served = [r for r in requests if r["route"] == route]
    assert served, requests
    return served


def test_claude_code_with_its_defaults_exits_cleanly(claude: Path, default_server: MlxdServe,
                                                     tmp_path: Path) -> None:
    since = len(default_server.requests())
    done = run_claude(claude, default_server, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    served = assert_clean(default_server, since, "/v1/messages")
    # its default request (3 system blocks, 24 tools) was rendered whole
    assert max(r["prompt_tokens"] for r in served) > 20_000


def test_codex_with_its_defaults_exits_cleanly(codex: Path, default_server: MlxdServe,
                                               tmp_path: Path) -> None:
    since = len(default_server.requests())
    done = run_codex(codex, default_server, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["type"] == "turn.completed", events
    assert_clean(default_server, since, "/v1/responses")


def test_claude_code_runs_a_tool_and_answers(claude: Path, tool_server: MlxdServe,
                                             tmp_path: Path) -> None:
    since = len(tool_server.requests())
    done = run_claude(claude, tool_server, tmp_path, "--allowedTools", "Bash")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "marker.txt").read_text().strip() == "mlxd-ok"  # Bash ran
    assert done.stdout.strip() == ANSWER
    assert len(assert_clean(tool_server, since, "/v1/messages")) >= 2  # call, then result


def test_codex_runs_a_tool_and_answers(codex: Path, tool_server: MlxdServe,
                                       tmp_path: Path) -> None:
    since = len(tool_server.requests())
    done = run_codex(codex, tool_server, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    items = [e["item"] for e in (json.loads(line) for line in done.stdout.splitlines()
                                 if line.startswith("{")) if e["type"] == "item.completed"]
    commands = [i for i in items if i["type"] == "command_execution"]
    assert commands and commands[0]["aggregated_output"].strip() == "mlxd-ok", items
    assert commands[0]["exit_code"] == 0
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [ANSWER]
    assert len(assert_clean(tool_server, since, "/v1/responses")) >= 2
