"""Admin API and the `mlxd ps | load | unload` commands against a real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from mlxd.cli import main
from mlxd.config import ServerConfig
from tests.helpers.server import free_port, running_server


def test_ps_load_unload_commands(tiny_model: Path, test_home: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ServerConfig(model=str(tiny_model), served_model_name="tiny", home=test_home,
                       no_starter=True)
    with running_server(cfg) as srv:
        assert main(["load", "tiny", "--url", srv.url]) == 0
        assert "tiny: loaded (state loaded" in capsys.readouterr().out
        assert main(["ps", "--url", srv.url]) == 0
        table = capsys.readouterr().out
        assert "tiny" in table and "loaded" in table and "text" in table
        assert main(["ps", "--url", srv.url, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows[0]["id"] == "tiny" and rows[0]["state"] == "loaded"
        # a loaded model's card: what its engine holds now, and its facts
        assert rows[0]["measured_bytes"] > 0 and rows[0]["context_length"] > 0
        assert main(["unload", "tiny", "--url", srv.url]) == 0
        assert "tiny: unloaded" in capsys.readouterr().out
        assert "measured_bytes" not in httpx.get(srv.url + "/v1/models/tiny").json()
        assert main(["unload", "missing", "--url", srv.url]) == 1
        assert "does not exist" in capsys.readouterr().err


def test_put_and_delete_models_are_persisted_to_the_registry(
        tiny_model: Path, tiny_model_b: Path, tmp_path: Path, test_home: Path) -> None:
    reg = tmp_path / "models.yaml"
    reg.write_text(yaml.safe_dump({"models": [{"name": "a", "source": str(tiny_model)}]}))
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        r = http.put("/v1/models", json={"name": "b", "source": str(tiny_model_b),
                                         "ttl_seconds": 60})
        assert r.status_code == 200, r.text
        assert r.json()["persisted"] is True and r.json()["kind"] == "text"
        names = [m["name"] for m in yaml.safe_load(reg.read_text())["models"]]
        assert names == ["a", "b"]
        chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        bad = http.put("/v1/models", json={"name": "c", "source": str(tmp_path / "missing")})
        assert bad.status_code == 400
        assert [m["name"] for m in yaml.safe_load(reg.read_text())["models"]] == ["a", "b"]
        assert http.delete("/v1/models/b").status_code == 200
        assert [m["name"] for m in yaml.safe_load(reg.read_text())["models"]] == ["a"]
        assert http.post("/v1/chat/completions", json=chat).status_code == 404


@pytest.mark.slow
def test_shutdown_during_a_load_exits_cleanly(smollm2_gguf: Path, tmp_path: Path) -> None:
    """SIGTERM during a slow first load (GGUF conversion): exit 0, the waiting request is
    answered (or dropped) rather than served, the load is abandoned with a log line, and
    nothing half-written is left where a model is looked for. The deadline is generous
    (a 2-core CI machine); what is checked is the behaviour."""
    port = free_port()
    home = tmp_path / "home"
    env = {**os.environ, "MLXD_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "mlxd", "serve", str(smollm2_gguf),
                             "--no-preload", "--port", str(port), "--served-model-name", "s"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_health(url, proc)
        body = {"model": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answers: list[int] = []
        threading.Thread(target=lambda: _quiet_post(url, body, answers), daemon=True).start()
        while httpx.get(url + "/v1/models").json()["data"][0]["state"] != "loading":
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output
        assert "Traceback" not in output, output
        assert 200 not in answers  # never served by an engine that shutdown gave up on
        # Either shutdown gave up on the load (the worker closes the engine when it ends)
        # or the load ended during shutdown's wait and was closed at once.
        assert ("still loading at shutdown" in output
                or "loaded after shutdown or removal began; closing it" in output), output
        converted = home / "models" / "converted"
        for folder in converted.iterdir() if converted.exists() else []:
            if not folder.name.startswith("."):  # hidden: a scratch folder, never loaded
                assert (folder / "config.json").exists() and \
                    (folder / "model.safetensors").exists(), folder
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_for_health(url: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not come up")


def _quiet_post(url: str, body: dict, answers: list[int]) -> None:
    try:
        answers.append(httpx.post(url + "/v1/chat/completions", json=body,
                                  timeout=120).status_code)
    except httpx.HTTPError:
        pass


def test_serving_a_hub_id_offline_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "MLXD_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "mlxd", "serve", "some-org/some-model",
                        "--port", str(free_port())], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    out = " ".join((r.stdout + r.stderr).split())
    assert "some-org/some-model" in out and "cannot download" in out
