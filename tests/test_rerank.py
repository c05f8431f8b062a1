"""Reranking: ``rerank_forward`` against transformers (torch CPU) and POST /v1/rerank over
HTTP. Cross-encoders are built at test time (tests/helpers/cross_encoders.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mlxd.config import ServerConfig
from mlxd.models.spec import ModelEntry
from mlxd.models.starter import STARTER_CHAT, STARTER_EMBEDDING
from tests.helpers.cross_encoders import (
    build_minilm_cross_encoder,
    build_tiny_roberta,
    build_tiny_xlm_roberta,
)
from tests.helpers.retrieval import (
    assert_openai_error,
    minilm_folder,
    model_state,
    registry_config,
)
from tests.helpers.server import RunningServer, running_server

pytestmark = [pytest.mark.reference]

QUERIES = ["what is the capital of france", "how do rivers form", "best pizza in naples",
           "symptoms of the flu", "who wrote hamlet", "python list comprehension"]
DOCUMENTS = [
    "Paris is the capital and most populous city of France.",
    "Rivers form when water from rain and snowmelt flows downhill in channels.",
    "Naples is famous for its wood-fired pizza margherita.",
    "Influenza causes fever, cough, sore throat and tiredness.",
    "Hamlet is a tragedy written by William Shakespeare around 1600.",
    " ".join(f"Paragraph {i}: a long document about bridges, rivers and the history of "
             f"cities, with many words so that the pair must be truncated." for i in range(40)),
]
PAIRS = [(q, d) for q in QUERIES for d in DOCUMENTS[:5]][:24] + \
        [(q, DOCUMENTS[5]) for q in QUERIES]  # 30 pairs; the last six need truncation


@pytest.fixture(scope="session")
def cross_encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross-encoders")
    return {"minilm-ce": build_minilm_cross_encoder(root / "minilm-ce", minilm_folder()),
            "tiny-roberta": build_tiny_roberta(root / "tiny-roberta"),
            "tiny-xlmr": build_tiny_xlm_roberta(root / "tiny-xlmr")}


def _reference_logits(folder: Path, pairs: list[tuple[str, str]], max_length: int) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    batch = tok([q for q, _ in pairs], [d for _, d in pairs], truncation="only_second",
                max_length=max_length, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.numpy()


def _engine_run(folder: Path, pairs: list[tuple[str, str]]) -> tuple[Any, np.ndarray, list[Any]]:
    """Load a RerankEngine on its own worker; logits of ``pairs`` through its batcher."""
    from mlxd.engines.encoders.rerank import RerankEngine
    from mlxd.runtime.worker import ModelWorker

    worker = ModelWorker("rerank-test")
    worker.start()
    engine = RerankEngine("rerank-test", folder, worker, ServerConfig(no_starter=True))
    try:
        worker.submit(engine.load).result()

        async def run() -> tuple[np.ndarray, list[Any]]:
            encoded = [e for q, d in pairs for e in await engine.encode(q, [d])]
            return await engine.logits(encoded), encoded

        logits, encoded = asyncio.run(run())
        worker.submit(engine.close).result()
    finally:
        worker.stop()
    return engine, logits, encoded


@pytest.mark.parametrize("name", ["minilm-ce", "tiny-roberta", "tiny-xlmr"])
def test_rerank_forward_matches_transformers(cross_encoders: dict[str, Path], name: str) -> None:
    from transformers import AutoTokenizer

    folder = cross_encoders[name]
    engine, ours, encoded = _engine_run(folder, PAIRS)
    ref = _reference_logits(folder, PAIRS, engine.max_length)
    tok = AutoTokenizer.from_pretrained(str(folder))
    for (q, d), enc in zip(PAIRS, encoded, strict=True):  # paired as the tokenizer pairs them
        expected = tok(q, d, truncation="only_second", max_length=engine.max_length)
        assert enc.input_ids == expected["input_ids"]
        if "token_type_ids" in expected:
            assert enc.token_type_ids == expected["token_type_ids"]
    assert sum(len(e) == engine.max_length for e in encoded) >= 6  # truncation was exercised
    diff = float(np.abs(ours - ref).max())
    print(f"\n{name}: max abs logit diff vs transformers {diff:.2e} over {len(PAIRS)} pairs")
    assert ours.shape == ref.shape
    assert diff <= 1e-4
    assert float(np.ptp(ref)) > 0.1  # the logits differ enough for the check to mean something


def test_unsupported_activation_is_a_clear_load_error(cross_encoders: dict[str, Path],
                                                      tmp_path: Path) -> None:
    from mlxd.engines.encoders.rerank import RerankEngine
    from mlxd.errors import ModelLoadError
    from mlxd.runtime.worker import ModelWorker

    folder = tmp_path / "mish"
    folder.mkdir()
    for item in cross_encoders["tiny-xlmr"].iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    config = (cross_encoders["tiny-xlmr"] / "config.json").read_text()
    (folder / "config.json").write_text(config.replace('"gelu"', '"mish"'))
    engine = RerankEngine("mish", folder, ModelWorker("mish"), ServerConfig(no_starter=True))
    with pytest.raises(ModelLoadError, match="activation 'mish' is not supported"):
        engine.load()


def test_unsupported_architecture_is_a_clear_load_error(tmp_path: Path) -> None:
    import json

    from mlxd.engines.encoders.cross_encoder import UnsupportedCrossEncoder, load_cross_encoder

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"]}))
    with pytest.raises(UnsupportedCrossEncoder, match="model_type 'deberta-v2' is not a supported"):
        load_cross_encoder(tmp_path)


# -- HTTP ----------------------------------------------------------------------------------------

def _entries(cross_encoders: dict[str, Path]) -> list[ModelEntry]:
    return [ModelEntry(name=name, source=str(path)) for name, path in cross_encoders.items()] + \
        [STARTER_EMBEDDING.model_copy(), STARTER_CHAT.model_copy()]


@pytest.fixture(scope="module")
def server(cross_encoders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           test_home: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("rerank")
    cfg = registry_config(tmp / "models.yaml", _entries(cross_encoders), test_home)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict_server(cross_encoders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                  test_home: Path) -> Iterator[RunningServer]:
    """At most 3 documents and 60 pair tokens per request."""
    tmp = tmp_path_factory.mktemp("rerank-strict")
    entries = [ModelEntry(name="tiny-xlmr", source=str(cross_encoders["tiny-xlmr"]))]
    cfg = registry_config(tmp / "models.yaml", entries, test_home, max_rerank_documents=3,
                          max_rerank_tokens=60)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_results_are_sorted_scores_with_original_indices(http: httpx.Client,
                                                         cross_encoders: dict[str, Path]) -> None:
    query = QUERIES[0]
    r = http.post("/v1/rerank", json={"model": "minilm-ce", "query": query,
                                      "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = _sigmoid(_reference_logits(cross_encoders["minilm-ce"],
                                          [(query, d) for d in DOCUMENTS], 512)[:, 0])
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCUMENTS)))
    assert [x["relevance_score"] for x in results] == sorted(
        (x["relevance_score"] for x in results), reverse=True)
    for x in results:
        assert x["relevance_score"] == pytest.approx(float(expected[x["index"]]), abs=1e-5)
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    assert body["model"] == "minilm-ce" and body["id"].startswith("rerank-")


def test_two_label_model_scores_the_positive_class(http: httpx.Client,
                                                   cross_encoders: dict[str, Path]) -> None:
    docs = DOCUMENTS[:4]
    r = http.post("/v1/rerank", json={"model": "tiny-roberta", "query": QUERIES[1],
                                      "documents": docs})
    logits = _reference_logits(cross_encoders["tiny-roberta"], [(QUERIES[1], d) for d in docs], 64)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    for x in r.json()["results"]:
        assert x["relevance_score"] == pytest.approx(float(probs[x["index"], 1]), abs=1e-5)


def test_all_three_paths_answer_alike(http: httpx.Client) -> None:
    body = {"model": "tiny-xlmr", "query": QUERIES[2], "documents": DOCUMENTS[:3]}
    answers = [http.post(path, json=body).json() for path in ("/v1/rerank", "/rerank",
                                                              "/v2/rerank")]
    assert answers[0]["results"] == answers[1]["results"] == answers[2]["results"]


def test_top_n_document_objects_and_return_documents(http: httpx.Client) -> None:
    docs = [{"text": d} for d in DOCUMENTS[:5]]
    full = http.post("/v1/rerank", json={"model": "minilm-ce", "query": QUERIES[4],
                                         "documents": docs}).json()["results"]
    top = http.post("/v1/rerank", json={"model": "minilm-ce", "query": QUERIES[4],
                                        "documents": docs, "top_n": 2,
                                        "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    assert all("document" not in x for x in top)
    assert full[0]["document"] == docs[full[0]["index"]]
    many = http.post("/v1/rerank", json={"model": "minilm-ce", "query": "q", "documents": docs,
                                         "top_n": 50}).json()["results"]
    assert len(many) == 5


def test_usage_counts_the_pair_tokens(http: httpx.Client, cross_encoders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cross_encoders["minilm-ce"]))
    docs = [DOCUMENTS[0], DOCUMENTS[5]]
    r = http.post("/v1/rerank", json={"model": "minilm-ce", "query": QUERIES[0],
                                      "documents": docs}).json()
    expected = sum(len(tok(QUERIES[0], d, truncation="only_second", max_length=512)["input_ids"])
                   for d in docs)
    assert r["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


@pytest.mark.parametrize(("body", "status", "fragment", "param"), [
    ({"query": "", "documents": ["a"]}, 400, "query must not be empty", "query"),
    ({"query": "   ", "documents": ["a"]}, 400, "query must not be empty", "query"),
    ({"query": "q", "documents": []}, 400, "documents must not be empty", "documents"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n", "top_n"),
    ({"query": "q", "documents": [1, 2]}, 400, "documents", None),
    ({"query": "q", "documents": [{"title": "no text"}]}, 400, "text", None),
    ({"documents": ["a"]}, 400, "query", "query"),
    ({"query": "word " * 80, "documents": ["a"]}, 400, "leaving no room for the document",
     "query"),
])
def test_bad_rerank_input_is_4xx(http: httpx.Client, body: dict[str, Any], status: int,
                                 fragment: str, param: str | None) -> None:
    r = http.post("/v1/rerank", json={"model": "tiny-xlmr", **body})
    assert_openai_error(r, status, fragment, param=param)


@pytest.mark.parametrize("model", [STARTER_EMBEDDING.name, STARTER_CHAT.name])
def test_other_kinds_are_400_naming_the_kinds_without_loading(server: RunningServer,
                                                              http: httpx.Client,
                                                              model: str) -> None:
    r = http.post("/v2/rerank", json={"model": model, "query": "q", "documents": ["a"]})
    err = assert_openai_error(r, 400, "/v2/rerank serves rerank models", param="model")
    assert err["code"] == "wrong_model_kind"
    assert model_state(server, model) == "unloaded"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    r = http.post("/rerank", json={"model": "nope", "query": "q", "documents": ["a"]})
    assert_openai_error(r, 404, "does not exist", param="model")


def test_too_many_documents_is_400_before_loading(strict_server: RunningServer) -> None:
    with strict_server.client() as c:
        r = c.post("/v1/rerank", json={"model": "tiny-xlmr", "query": "q",
                                       "documents": ["a", "b", "c", "d"]})
        assert_openai_error(r, 400, "at most 3", param="documents")
    assert model_state(strict_server, "tiny-xlmr") == "unloaded"


def test_too_many_tokens_is_400_before_any_forward_pass(strict_server: RunningServer) -> None:
    with strict_server.client() as c:
        r = c.post("/v1/rerank", json={"model": "tiny-xlmr", "query": "rivers",
                                       "documents": [DOCUMENTS[1], DOCUMENTS[5]]})
        err = assert_openai_error(r, 400, "at most 60", param="documents")
        assert err["code"] == "too_many_tokens"
        engine = strict_server.ctx.manager.get("tiny-xlmr").engine
        assert engine.stats().counters["rows"] == 0  # nothing but the warm-up ran
        ok = c.post("/v1/rerank", json={"model": "tiny-xlmr", "query": "rivers",
                                        "documents": ["short one"]})
        assert ok.status_code == 200 and engine.stats().counters["rows"] == 1
