"""One memory budget over every kind: text, embedding and rerank models evict each other
least-recently-used first, and a text model's estimate is its weights plus the KV reserve
for its configured context."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.config import ServerConfig
from mlxd.models.catalog import registration_for
from mlxd.models.residency import State
from mlxd.models.spec import ModelEntry, ServingDefaults
from tests.helpers.retrieval import minilm_folder, registry_config
from tests.helpers.server import RunningServer, running_server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def gqa_model(session_dir: Path, tiny_model: Path) -> Path:
    """A tiny Llama with grouped-query attention (2 KV heads for 4 query heads)."""
    from tests.helpers.tiny_models import build_llama

    out = session_dir / "tiny-llama-gqa"
    if not (out / "model.safetensors").exists():
        build_llama(out, hidden=64, layers=3, heads=4, kv_heads=2, context=1024, seed=3,
                    tokenizer_from=tiny_model)
    return out


def _expected_kv_bytes_per_token(folder: Path) -> int:
    """K and V, per layer, per KV head, per head dimension, float32: from config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


@pytest.mark.parametrize(("max_num_seqs", "context", "reserve_tokens", "tokens"), [
    (4, 256, 32_768, 4 * 256),  # the configured sequences x context
    (8, 1024, 3_000, 3_000),  # capped by --kv-reserve-tokens
])
def test_text_estimate_is_weights_plus_kv_for_the_configured_context(
        gqa_model: Path, test_home: Path, max_num_seqs: int, context: int,
        reserve_tokens: int, tokens: int) -> None:
    config = ServerConfig(home=test_home, no_starter=True, max_num_seqs=max_num_seqs,
                          max_context=context, kv_reserve_tokens=reserve_tokens,
                          prefix_cache_bytes=0)
    reg = registration_for(ModelEntry(name="gqa", source=str(gqa_model)), config, 2**30)
    weights = (gqa_model / "model.safetensors").stat().st_size
    kv = _expected_kv_bytes_per_token(gqa_model) * tokens
    assert _expected_kv_bytes_per_token(gqa_model) == 2 * 3 * 2 * 16 * 4  # GQA: 2 KV heads
    assert (reg.estimate, reg.reserve) == (weights + kv, kv)


def test_an_entry_context_and_the_prefix_cache_add_to_the_reserve(
        gqa_model: Path, test_home: Path) -> None:
    config = ServerConfig(home=test_home, no_starter=True, max_num_seqs=2, max_context=4096,
                          prefix_cache_bytes=5 * MiB)
    entry = ModelEntry(name="gqa", source=str(gqa_model),
                       defaults=ServingDefaults(max_context=512, max_num_seqs=3))
    reg = registration_for(entry, config, 2**30)
    kv = _expected_kv_bytes_per_token(gqa_model) * 3 * 512  # the entry's limits win
    assert reg.reserve == kv + 5 * MiB
    assert reg.estimate == (gqa_model / "model.safetensors").stat().st_size + kv + 5 * MiB


# -- text + embedding + rerank under one budget ------------------------------------------


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, session_dir: Path, tiny_model: Path,
          test_home: Path) -> Iterator[RunningServer]:
    from tests.helpers.cross_encoders import build_tiny_roberta

    rerank = session_dir / "budget-rerank"
    if not (rerank / "config.json").exists():
        build_tiny_roberta(rerank)
    # 200 MiB: the embedding model (130) fits beside one small model (40), not beside two.
    entries = [ModelEntry(name="chat", source=str(tiny_model), estimated_memory=40 * MiB),
               ModelEntry(name="rr", source=str(rerank), estimated_memory=40 * MiB),
               ModelEntry(name="emb", source=str(minilm_folder()), estimated_memory=130 * MiB)]
    cfg = registry_config(tmp_path_factory.mktemp("mixed") / "models.yaml", entries, test_home,
                          memory_budget="200MiB", contention="fail", no_starter=True,
                          enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


def _use(http: httpx.Client, name: str) -> None:
    if name == "chat":
        r = http.post("/v1/chat/completions", json={
            "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    elif name == "rr":
        r = http.post("/v1/rerank", json={"model": name, "query": "a", "documents": ["b"]})
    else:
        r = http.post("/v1/embeddings", json={"model": name, "input": "a"})
    assert r.status_code == 200, r.text


def _loaded(srv: RunningServer) -> set[str]:
    return {r.name for r in srv.ctx.manager.residencies() if r.state == State.LOADED}


def test_kinds_evict_each_other_least_recently_used_first(mixed: RunningServer) -> None:
    manager = mixed.ctx.manager
    with mixed.client() as http:
        _use(http, "chat")
        _use(http, "rr")
        assert _loaded(mixed) == {"chat", "rr"}
        evictions = manager.evictions
        _use(http, "emb")  # 40 + 40 + 130 > 200: the text model, least recently used, goes
        assert _loaded(mixed) == {"rr", "emb"}
        assert manager.evictions == evictions + 1
        _use(http, "rr")  # now the embedding model is the least recently used...
        _use(http, "chat")  # ...so it goes, though it was loaded after the reranker
        assert _loaded(mixed) == {"rr", "chat"}
        assert manager.evictions == evictions + 2
        assert manager.used_bytes() <= manager.policy.budget_bytes
