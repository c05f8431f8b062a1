"""The engine registry (issue 10 item 2): a model whose kind has no engine, or whose
optional extra is not installed, is a 400 naming the kind and the extra before any
load; ``/v1/models`` says which kinds this install serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.engines.registry import ENGINES, EXTRA_MODULES, EngineRegistry
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.models.starter import STARTER_EMBEDDING
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, free_port, running_server

HI = [{"role": "user", "content": "hi"}]
QWEN2_VL = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "vision_config": {"depth": 2}, "max_position_embeddings": 2048}


def _no_embeddings_extra(module: str) -> bool:
    """A probe for an install without the ``embeddings`` extra (it is installed here)."""
    return module not in EXTRA_MODULES["embeddings"]


def _no_extras(module: str) -> bool:
    """A probe for the base install: no optional extra (they are all installed here)."""
    return False


def test_every_kind_has_a_registry_entry_and_its_extra_is_known() -> None:
    assert set(ENGINES) == set(ModelKind)
    assert all(s.extra is None or s.extra in EXTRA_MODULES for s in ENGINES.values())


def test_this_install_serves_every_kind() -> None:
    assert set(EngineRegistry().servable_kinds()) == set(ModelKind)


def test_missing_mlx_whisper_names_its_no_deps_install() -> None:
    engines = EngineRegistry(probe=lambda module: module != "mlx_whisper")
    refusal = engines.refusal(ModelKind.STT)
    assert refusal is not None and "missing mlx_whisper" in refusal
    assert "pip install --no-deps 'mlx-whisper>=0.4.3'" in refusal


def test_a_missing_extra_is_named_with_its_install_command() -> None:
    engines = EngineRegistry(probe=_no_embeddings_extra)
    for kind in (ModelKind.EMBEDDING, ModelKind.RERANK):
        refusal = engines.refusal(kind)
        assert refusal is not None
        assert "'embeddings' extra is not installed" in refusal
        assert "pip install 'mlxd[embeddings]'" in refusal
    assert engines.refusal(ModelKind.TEXT) is None  # the base install needs no extra


@pytest.fixture(scope="module")
def unservable(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
               test_home: Path) -> Iterator[RunningServer]:
    """A server with a text model, a vision model (a config folder) and an embedding model
    on an install without the optional extras (simulated: they are installed here)."""
    root = tmp_path_factory.mktemp("engine-registry")
    vision = root / "tiny-vl"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps(QWEN2_VL))
    entries = [ModelEntry(name="tiny", source=str(tiny_model)),
               ModelEntry(name="vl", source=str(vision)), STARTER_EMBEDDING.model_copy()]
    cfg = registry_config(root / "models.yaml", entries, test_home)
    with running_server(cfg, engines=EngineRegistry(probe=_no_extras)) as srv:
        yield srv


def _never_loaded(srv: RunningServer, name: str) -> None:
    """No load was attempted: a failed one leaves the model ``failed`` with its error."""
    res = srv.ctx.manager.get(name)
    assert (str(res.state), res.loads, res.last_error) == ("unloaded", 0, None)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/models/load", {}),
])
def test_a_kind_without_an_engine_is_a_400_before_any_load(
        unservable: RunningServer, path: str, body: dict[str, Any]) -> None:
    srv = unservable
    with srv.client() as http:
        r = http.post(path, json={"model": "vl", **body})
    err = assert_openai_error(r, 400, "is of kind vision", param="model")
    assert "'vision' extra" in err["message"] and err["code"] == "model_kind_unavailable"
    _never_loaded(srv, "vl")


def test_the_anthropic_api_refuses_it_in_its_own_shape(
        unservable: RunningServer) -> None:
    srv = unservable
    with srv.client() as http:
        r = http.post("/v1/messages", json={"model": "vl", "max_tokens": 4, "messages": HI})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and "kind vision" in body["error"]["message"]
    assert "'vision' extra" in body["error"]["message"]


def test_a_missing_extra_is_a_400_naming_it_before_any_load(
        unservable: RunningServer) -> None:
    srv = unservable
    name = STARTER_EMBEDDING.name
    with srv.client() as http:
        r = http.post("/v1/embeddings", json={"model": name, "input": "hi"})
    err = assert_openai_error(r, 400, "is of kind embedding", param="model")
    assert "pip install 'mlxd[embeddings]'" in err["message"]
    _never_loaded(srv, name)


def test_a_wrong_endpoint_still_says_wrong_kind_first(
        unservable: RunningServer) -> None:
    srv = unservable
    with srv.client() as http:
        r = http.post("/v1/completions", json={"model": "vl", "prompt": "hi"})
    assert assert_openai_error(r, 400, "serves text models")["code"] == "wrong_model_kind"


def test_models_list_shows_what_this_install_can_serve(
        unservable: RunningServer) -> None:
    srv = unservable
    with srv.client() as http:
        body = http.get("/v1/models").json()
        one = http.get("/v1/models/vl").json()
    assert body["servable_kinds"] == ["text"]
    cards = {c["id"]: c for c in body["data"]}
    assert cards["tiny"]["servable"] is True and "unservable_reason" not in cards["tiny"]
    assert cards["vl"]["servable"] is False and "'vision' extra" in cards["vl"]["unservable_reason"]
    emb = cards[STARTER_EMBEDDING.name]
    assert emb["servable"] is False and "mlxd[embeddings]" in emb["unservable_reason"]
    assert one["servable"] is False
    _never_loaded(srv, "vl")


def test_the_real_install_serves_every_family_it_has_an_engine_for(
        mixed_server: RunningServer) -> None:
    with httpx.Client(base_url=mixed_server.url, timeout=60) as http:
        body = http.get("/v1/models").json()
    assert {"text", "embedding", "rerank", "vision"} <= set(body["servable_kinds"])
    assert all(card["servable"] for card in body["data"])


def test_serve_refuses_to_preload_a_kind_it_cannot_serve_before_downloading(
        tmp_path: Path) -> None:
    """``mlxd serve`` names the kind and the extra and exits, instead of fetching weights
    (offline here: a download attempt would fail with "cannot download") it cannot use."""
    registry = tmp_path / "models.yaml"
    registry.write_text("models:\n- name: vl\n  source: some-org/some-vl\n  kind: vision\n"
                        "  preload: true\n")
    env = {**os.environ, "MLXD_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    # this install has the vision extra: the server runs as if mlx-vlm were missing
    without_vision = ("import runpy, sys; sys.modules['mlx_vlm'] = None; "
                      "sys.argv[0] = 'mlxd'; runpy.run_module('mlxd', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", without_vision, "serve", "--models-config",
                        str(registry), "--port", str(free_port())], env=env,
                       capture_output=True, text=True, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert "'vl' is of kind vision" in out and "'vision' extra" in out
    assert "cannot download" not in out

