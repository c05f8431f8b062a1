"""Manifests, the fast GGUF header reader, ``show --verify``, and pushing to a running server."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from mlxd.config import ServerConfig
from mlxd.sources.manifest import (
    ManifestError,
    finish_manifest,
    new_manifest,
    read_manifest,
    write_manifest,
)
from tests.helpers.server import running_server
from tests.helpers.workflow import mlxd


def test_gguf_header_reader_agrees_with_gguf_reader(smollm2_gguf: Path) -> None:
    from mlxd.sources.gguf_convert import GGUFModel
    from mlxd.sources.gguf_header import read_gguf_header

    fast, full = read_gguf_header(smollm2_gguf), GGUFModel(smollm2_gguf)
    assert fast.arch == full.arch == "llama"
    for key in ("llama.context_length", "llama.rope.freq_base", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template", "general.file_type"):
        assert fast.metadata[key] == full.get(key), key
    assert fast.array_lengths["tokenizer.ggml.tokens"] == len(full.get("tokenizer.ggml.tokens"))
    assert [(t.name, t.shape, t.type_name) for t in fast.tensors] == [
        (t.name, tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name)
        for t in full.tensors]


def test_manifest_is_schema_versioned_sorted_and_readable(tmp_path: Path) -> None:
    manifest = new_manifest("conversion", command=["mlxd", "model", "convert", "x"])
    manifest["zeta"], manifest["alpha"] = 1, 2
    path = write_manifest(tmp_path / "conversion.json", finish_manifest(manifest, "complete"))
    text = path.read_text()
    keys = list(json.loads(text))
    assert keys == sorted(keys)
    data = read_manifest(path)
    assert data["schema"] == "mlxd.conversion/1" and data["status"] == "complete"
    assert data["seconds"] >= 0 and data["tools"]["mlxd"]
    (tmp_path / "other.json").write_text('{"schema": "something/else"}')
    with pytest.raises(ManifestError, match="not an mlxd manifest"):
        read_manifest(tmp_path / "other.json")


@pytest.fixture
def acquired_tiny(tmp_path: Path, tiny_model: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    result = mlxd(home, "acquire", str(tiny_model), "--name", "tiny")
    assert result.rc == 0, result.stderr
    artifact = Path(result.json["outputs"]["artifact"])
    assert mlxd(home, "register", "tiny", str(artifact)).rc == 0
    return home, artifact


def test_acquire_link_shares_the_files(tmp_path: Path, tiny_model: Path) -> None:
    result = mlxd(tmp_path / "home", "acquire", str(tiny_model), "--link")
    assert result.rc == 0, result.stderr
    linked = Path(result.json["outputs"]["artifact"]) / "model.safetensors"
    assert linked.stat().st_ino == (tiny_model / "model.safetensors").stat().st_ino


def test_show_verify_reports_a_changed_file(acquired_tiny: tuple[Path, Path]) -> None:
    home, artifact = acquired_tiny
    clean = mlxd(home, "show", "tiny", "--verify")
    assert clean.rc == 0 and clean.json["problems"] == []
    assert [c["step"] for c in clean.json["chain"]] == ["registration", "acquisition"]
    weights = artifact / "model.safetensors"  # same size, one byte other, mtime put back:
    st, data = weights.stat(), bytearray(weights.read_bytes())  # only sha256 can tell
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    same_size = mlxd(home, "show", "tiny", "--verify")
    assert same_size.rc == 1
    assert "registration.json: model.safetensors: sha256 differs" in same_size.json["problems"]
    with open(artifact / "config.json", "a") as fh:
        fh.write(" ")
    tampered = mlxd(home, "show", "tiny", "--verify")
    assert tampered.rc == 1
    assert any("config.json: size" in p for p in tampered.json["problems"])


def test_register_pushes_the_entry_to_a_running_server(acquired_tiny: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    home, artifact = acquired_tiny
    config = ServerConfig(home=home, no_starter=True, admin_api_key="admin-secret",
                          models_config=tmp_path / "server-models.yaml",
                          allow_no_models=True)  # the push creates the file
    with running_server(config) as srv:
        registry = (home / "models.yaml").read_bytes()
        refused = mlxd(home, "register", "pushed", str(artifact), "--url", srv.url,
                       "--api-key", "wrong")
        assert refused.rc == 2 and "refused the entry (403)" in refused.json["error"]
        assert (home / "models.yaml").read_bytes() == registry
        result = mlxd(home, "register", "pushed", str(artifact), "--url", srv.url,
                      "--api-key", "admin-secret")
        assert result.rc == 0, result.stderr
        assert result.json["pushed"]["persisted"] is True
        assert "pushed" in srv.ctx.manager.names
        served = yaml.safe_load((tmp_path / "server-models.yaml").read_text())
        assert [m["name"] for m in served["models"]] == ["pushed"]


def test_qualify_against_a_url_records_the_result_locally(acquired_tiny: tuple[Path, Path],
                                                         tiny_model: Path) -> None:
    home, artifact = acquired_tiny
    config = ServerConfig(home=home, no_starter=True, models_config=home / "models.yaml")
    with running_server(config) as srv:
        result = mlxd(home, "qualify", "tiny", "--url", srv.url, "--skip", "bench")
    assert result.rc == 1  # random weights: it loads and talks, but it is no language model
    assert result.json["server"] == srv.url
    assert result.json["checks"]["load"]["passed"] is True
    assert result.json["checks"]["perplexity"]["passed"] is False
    entry = yaml.safe_load((home / "models.yaml").read_text())["models"][0]
    assert entry["qualification"]["status"] == "fail"
    assert Path(entry["qualification"]["manifest"]) == artifact / "qualification.json"


def test_registering_a_staging_folder_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    staging = tmp_path / ".model.partial-123"
    shutil.copytree(tiny_model, staging)
    result = mlxd(tmp_path / "home", "register", "half", str(staging))
    assert result.rc == 2 and "unfinished staging folder" in result.json["error"]
