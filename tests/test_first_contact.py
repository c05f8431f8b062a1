"""First-contact defects (issue 27, section 6): what a new user meets in the first minute.

- No prefix matching in the CLI: ``--model`` is not read as ``--models-config``.
- A missing ``--models-config`` file, or nothing at all to serve, is a startup error;
  ``--allow-no-models`` starts empty on purpose (models come by PUT /v1/models), and
  then a 404 says that the server has no models.
- ``mlxd serve`` on a port in use fails at once with one line, before preparing models.
- /favicon.ico is served; transformers' "PyTorch was not found" stays out of the output.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxd.cli import build_parser, main
from mlxd.config import ServerConfig
from tests.helpers.retrieval import assert_openai_error
from tests.helpers.server import free_port, running_server

REPO = Path(__file__).resolve().parent.parent


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def test_no_parser_of_the_cli_matches_prefixes() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 10  # serve, ps, ..., model inspect|acquire|..., bench
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_model_flag_is_not_taken_for_models_config(capsys: pytest.CaptureFixture[str]) -> None:
    """docs once said `mlxd serve --model X`: it used to mean `--models-config X`."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "some/model", "--served-model-name", "m"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --model" in capsys.readouterr().err


def _serve(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLXD_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("MLXD_MODELS_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "mlxd", "serve", "--blas", "off", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_models_config_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    r = _serve("--models-config", str(missing), "--port", str(free_port()), home=tmp_path)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"--models-config {missing}: no such file" in out and "--allow-no-models" in out


def test_nothing_to_serve_is_an_error_naming_the_ways_out(tmp_path: Path) -> None:
    r = _serve("--no-starter", "--port", str(free_port()), home=tmp_path / "empty-home")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert "nothing to serve" in out and "mlxd serve MODEL" in out and "--allow-no-models" in out


def test_an_empty_server_says_so_in_its_404(tmp_path: Path) -> None:
    """The one legitimate empty start: an admin adds models at run time (PUT /v1/models)."""
    config = ServerConfig(home=tmp_path, no_starter=True, allow_no_models=True,
                          models_config=tmp_path / "served.yaml")
    with running_server(config) as srv, srv.client() as http:
        assert http.get("/v1/models").json()["data"] == []
        r = http.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
        err = assert_openai_error(r, 404, "serves no models at all", param="model")
        assert "PUT /v1/models" in err["message"]


def test_a_port_in_use_fails_at_once_before_preparing_models(tiny_model: Path,
                                                             tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = _serve(str(tiny_model), "--no-starter", "--port", str(port), home=tmp_path)
        elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: cannot listen on 127.0.0.1:{port}: address already in use (is "
                      "another server running there? choose another --port)"], r.stderr
    assert "preparing" not in r.stderr and "Traceback" not in r.stderr
    assert elapsed < 60  # the process start; no model was converted or loaded


def test_favicon_is_served_without_a_key(tmp_path: Path) -> None:
    config = ServerConfig(home=tmp_path, no_starter=True, allow_no_models=True, api_key="k")
    with running_server(config) as srv:
        r = httpx.get(srv.url + "/favicon.ico", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon"
    assert r.content[:4] == b"\x00\x00\x01\x00"  # an ICO file's header


def test_conversion_without_torch_prints_no_pytorch_warning(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    """transformers' "PyTorch was not found. Models won't be available" reads as fatal in
    the middle of a conversion; mlxd needs no torch, so it is silenced."""
    from tests.helpers.gguf_models import write_gguf

    gguf_file = write_gguf(tiny_model, tmp_path / "tiny.gguf", "llama")
    without_torch = ("import runpy, sys; sys.modules['torch'] = None; "
                     "sys.argv[0] = 'mlxd'; runpy.run_module('mlxd', run_name='__main__')")
    env = {**os.environ, "MLXD_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    r = subprocess.run([sys.executable, "-c", without_torch, "model", "convert", str(gguf_file),
                        "--out", str(tmp_path / "mlx"), "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PyTorch was not found" not in r.stderr
