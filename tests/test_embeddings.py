"""POST /v1/embeddings with the real all-MiniLM-L6-v2 weights, checked against
sentence-transformers (torch CPU), through the real openai SDK and httpx."""

from __future__ import annotations

import base64
import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.models.starter import STARTER_CHAT, STARTER_EMBEDDING
from tests.helpers.retrieval import (
    assert_openai_error,
    matryoshka_copy,
    minilm_folder,
    model_state,
    registry_config,
)
from tests.helpers.server import RunningServer, running_server

pytestmark = [pytest.mark.real_model, pytest.mark.reference]

MODEL = STARTER_EMBEDDING.name
MRL = "minilm-mrl"
LONG = " ".join(f"Sentence {i} of a long report on rivers, bridges and the cities around them."
                for i in range(60))  # ~900 tokens: truncated to the model's 256
SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through "
    "the woods.", "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome!", "The cat sits outside", "The new movie is so great",
    "I love pasta", "Do you like pizza?", "Paris is the capital of France.",
    "Das ist ein deutscher Satz über Häuser und Bäume.",
    "Ceci est une phrase française, n'est-ce pas ?",
    "¿Dónde está la biblioteca?", "東京は日本の首都です。", "北京是中国的首都。",
    "Москва — столица России.", "القاهرة هي عاصمة مصر",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "naïve café résumé façade Zürich", "emoji party 🎉🎉🔥 tonight 🍕", "...", "?!?!", "---",
    "!!!", "()", "😀", "42", "3.14159 2.71828 1.41421", "e = mc^2",
    "def add(a, b):\n    return a + b", "SELECT * FROM users WHERE id = 7;",
    "https://example.com/path?query=1&x=2", "user@example.com", "ALL CAPS SENTENCE HERE",
    "mIxEd CaSe TeXt", "   leading and trailing spaces   ", "tabs\tand\nnewlines\n",
    "a", "The quick brown fox jumps over the lazy dog. " * 8, LONG,
    LONG.upper(), "word " * 400, "Short.", "Supercalifragilisticexpialidocious",
    "The weather today is sunny with a chance of rain in the evening.",
]


@pytest.fixture(scope="module")
def minilm() -> Path:
    return minilm_folder()


@pytest.fixture(scope="module")
def reference(minilm: Path) -> Any:
    """sentence-transformers on torch CPU: the reference implementation."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


def _entries(minilm: Path, tmp: Path) -> list[ModelEntry]:
    mrl = matryoshka_copy(minilm, tmp / "minilm-mrl", [64, 128, 256])
    return [STARTER_EMBEDDING.model_copy(), STARTER_CHAT.model_copy(),
            ModelEntry(name=MRL, source=str(mrl), kind=ModelKind.EMBEDDING)]


@pytest.fixture(scope="module")
def server(minilm: Path, tmp_path_factory: pytest.TempPathFactory,
           test_home: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("embeddings")
    cfg = registry_config(tmp / "models.yaml", _entries(minilm, tmp), test_home)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory,
                  test_home: Path) -> Iterator[RunningServer]:
    """Overflow policy 'error' and at most 4 inputs per request."""
    tmp = tmp_path_factory.mktemp("embeddings-strict")
    cfg = registry_config(tmp / "models.yaml", [STARTER_EMBEDDING.model_copy()], test_home,
                          embedding_overflow="error", max_embedding_inputs=4)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def _vectors(response: Any) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)],
                    dtype=np.float32)


# -- numerics against sentence-transformers ---------------------------------------------

def test_minilm_matches_sentence_transformers_on_varied_sentences(client: OpenAI,
                                                                  reference: Any) -> None:
    assert len(SENTENCES) == 50
    ours = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES,
                                             encoding_format="float"))
    ref = reference.encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    cosines = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"\nMiniLM vs sentence-transformers: min cosine {cosines.min():.7f}, "
          f"max abs diff {np.abs(ours - ref).max():.2e}")
    worst = [(s[:30], c) for s, c in zip(SENTENCES, cosines, strict=True) if c < 0.9999]
    assert cosines.min() >= 0.9999, worst
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_published_similarity_of_eating_sentences(client: OpenAI) -> None:
    a, b = _vectors(client.embeddings.create(
        model=MODEL, input=["A man is eating food.", "A man is eating a piece of bread."]))
    similarity = float(a @ b)
    print(f"\nsimilarity: {similarity:.4f}")
    assert similarity == pytest.approx(0.755, abs=0.005)


def test_base64_encoding_decodes_to_the_float_vectors(client: OpenAI) -> None:
    texts = ["base64 please", "and floats too"]
    floats = _vectors(client.embeddings.create(model=MODEL, input=texts, encoding_format="float"))
    # Asked for explicitly, the SDK hands back the base64 strings as they came.
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(str(d.embedding)), dtype="<f4")
                        for d in raw.data])
    # Left out, the SDK asks for base64 itself and decodes it with numpy.
    default = _vectors(client.embeddings.create(model=MODEL, input=texts))
    assert np.array_equal(decoded, floats)
    assert np.array_equal(default, floats)


def test_response_has_openai_shape_and_counts_tokens(client: OpenAI, reference: Any) -> None:
    texts = ["one two three", LONG]
    r = client.embeddings.create(model=MODEL, input=texts)
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == [0, 1]
    assert all(d.object == "embedding" and len(d.embedding) == 384 for d in r.data)
    tok = reference.tokenizer
    expected = len(tok("one two three")["input_ids"]) + 256  # the long one is truncated
    assert r.usage.prompt_tokens == expected == r.usage.total_tokens


def test_token_id_inputs_embed_like_their_text(client: OpenAI, reference: Any) -> None:
    texts = ["token ids are accepted", "as lists of lists too"]
    ids = [reference.tokenizer(t)["input_ids"] for t in texts]
    by_text = _vectors(client.embeddings.create(model=MODEL, input=texts))
    one = _vectors(client.embeddings.create(model=MODEL, input=ids[0]))
    many = _vectors(client.embeddings.create(model=MODEL, input=ids))
    assert np.allclose(one[0], by_text[0], atol=1e-5)
    assert np.allclose(many, by_text, atol=1e-5)


def test_openais_default_name_reaches_the_starter_model(client: OpenAI) -> None:
    texts = ["tools send OpenAI's model name", "and get this model's vectors"]
    ours = _vectors(client.embeddings.create(model=MODEL, input=texts))
    aliased = client.embeddings.create(model="text-embedding-3-small", input=texts)
    assert np.allclose(_vectors(aliased), ours, atol=1e-6)


# tiktoken cl100k_base ids of "hello world", what LangChain's OpenAIEmbeddings sends by
# default: inside MiniLM's vocabulary (30522), so only their missing [CLS] tells them apart.
CL100K_HELLO_WORLD = [15339, 1917]


def test_another_tokenizers_ids_are_refused_not_embedded(http: httpx.Client,
                                                         reference: Any) -> None:
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": [CL100K_HELLO_WORLD]})
    err = assert_openai_error(r, 400, "must come from this model's own tokenizer",
                              param="input")
    assert "check_embedding_ctx_length=False" in err["message"]
    assert err["code"] == "foreign_token_ids"
    bare = reference.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": bare})
    assert_openai_error(r, 400, "does not start with [101]", param="input")


def test_concurrent_requests_get_their_own_vectors(client: OpenAI) -> None:
    groups = [[f"request {g} sentence {i} about topic {g * i}" for i in range(1 + g % 4)]
              for g in range(8)]
    alone = [_vectors(client.embeddings.create(model=MODEL, input=g)) for g in groups]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda g: _vectors(client.embeddings.create(model=MODEL,
                                                                            input=g)), groups))
    for a, b in zip(alone, together, strict=True):
        assert np.allclose(a, b, atol=1e-5)


# -- Matryoshka dimensions -------------------------------------------------------------------

def test_dimensions_truncate_and_renormalise_where_declared(client: OpenAI) -> None:
    texts = ["matryoshka dolls nest", "inside one another"]
    full = _vectors(client.embeddings.create(model=MRL, input=texts))
    cut = _vectors(client.embeddings.create(model=MRL, input=texts, dimensions=128))
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    assert cut.shape == (2, 128)
    assert np.allclose(cut, expected, atol=1e-6)
    assert np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)


def test_dimensions_not_declared_by_the_model_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": 128})
    assert_openai_error(r, 400, "does not declare matryoshka", param="dimensions")


def test_dimensions_outside_the_declared_sizes_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": MRL, "input": "x", "dimensions": 100})
    assert_openai_error(r, 400, "[64, 128, 256, 384]", param="dimensions")


# -- bad inputs ------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "fragment"), [
    ({"input": []}, "must not be empty"),
    ({"input": ""}, "input is an empty string"),
    ({"input": ["fine", ""]}, "input[1] is an empty string"),
    ({"input": [[]]}, "input[0] is an empty token list"),
    ({"input": [1, -5]}, "non-negative integers"),
    ({"input": [[101, 2000], [101, 99999999]]}, "outside this model's vocabulary"),
    ({"input": ["text", 3]}, "input[1] is int"),
    ({"input": [1.5]}, "input[0] is float"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({}, "input"),
])
def test_bad_input_is_400(http: httpx.Client, body: dict[str, Any], fragment: str) -> None:
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert_openai_error(r, 400, fragment)


def test_chat_model_name_is_400_naming_the_kinds_without_loading(server: RunningServer,
                                                                 http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": STARTER_CHAT.name, "input": "hello"})
    err = assert_openai_error(r, 400, "serves embedding models", param="model")
    assert err["code"] == "wrong_model_kind" and "text model" in err["message"]
    assert model_state(server, STARTER_CHAT.name) == "unloaded"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": "no-such-model", "input": "hello"})
    assert_openai_error(r, 404, "does not exist", param="model")


def test_too_many_inputs_is_400_before_loading(strict_server: RunningServer) -> None:
    with strict_server.client() as http:
        r = http.post("/v1/embeddings", json={"model": MODEL, "input": ["a"] * 5})
        assert_openai_error(r, 400, "at most 4", param="input")
    assert model_state(strict_server, MODEL) == "unloaded"


def test_input_over_the_limit_with_error_policy_is_400(strict_server: RunningServer) -> None:
    with strict_server.client() as http:
        r = http.post("/v1/embeddings", json={"model": MODEL, "input": ["short", LONG]})
        err = assert_openai_error(r, 400, "input[1] is", param="input")
        assert err["code"] == "context_length_exceeded" and "than 256 tokens" in err["message"]
        ok = http.post("/v1/embeddings", json={"model": MODEL, "input": ["short", "fine"]})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 6


def test_loaded_model_describes_its_pooling(server: RunningServer, client: OpenAI,
                                            http: httpx.Client) -> None:
    client.embeddings.create(model=MODEL, input="load it")
    card = next(m for m in http.get("/v1/models").json()["data"] if m["id"] == MODEL)
    assert card["kind"] == "embedding" and card["state"] == "loaded"
    assert (card["dimensions"], card["max_input_tokens"], card["pooling"],
            card["normalize"]) == (384, 256, "mean", True)
