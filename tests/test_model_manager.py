"""ModelManager and ResidencyManager with real engines (tiny models built at test time)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mlxd.config import ServerConfig
from mlxd.models.residency import State
from tests.helpers.server import RunningServer, running_server

MB = 1024 * 1024


def chat(http: httpx.Client, model: str, max_tokens: int = 4, **kw: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens, "temperature": 0, **kw})


def write_registry(path: Path, models: list[dict], **manager: object) -> Path:
    path.write_text(yaml.safe_dump({"manager": manager, "models": models}))
    return path


@pytest.fixture(scope="module")
def three_models(session_dir: Path, tiny_model: Path, tiny_model_b: Path) -> list[Path]:
    from tests.helpers.tiny_models import build_llama

    c = session_dir / "tiny-llama-c"
    if not c.exists():
        build_llama(c, hidden=48, layers=1, heads=4, seed=2, tokenizer_from=tiny_model)
    return [tiny_model, tiny_model_b, c]


@pytest.fixture
def budget_server(three_models: list[Path], tmp_path: Path, test_home: Path
                  ) -> Iterator[RunningServer]:
    models = [{"name": n, "source": str(p), "estimated_memory": "30MiB"}
              for n, p in zip("abc", three_models)]
    reg = write_registry(tmp_path / "models.yaml", models, memory_budget="70MiB",
                         contention="wait", wait_timeout_s=30)
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv:
        yield srv


def test_sixteen_concurrent_first_requests_share_one_load(budget_server: RunningServer) -> None:
    with budget_server.client() as http, cf.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: chat(http, "a").status_code, range(16)))
    assert codes == [200] * 16
    assert budget_server.ctx.manager.get("a").loads == 1


def test_round_robin_over_three_models_stays_within_a_two_model_budget(
        budget_server: RunningServer) -> None:
    manager = budget_server.ctx.manager
    budget = manager.policy.budget_bytes
    peak = {"estimate": 0, "measured": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak["estimate"] = max(peak["estimate"], manager.used_bytes())
            live = sum(r.engine.memory_bytes() for r in manager.residencies()
                       if r.state == State.LOADED and r.engine is not None)
            peak["measured"] = max(peak["measured"], live)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    names = ["a", "b", "c"] * 6
    with budget_server.client() as http, cf.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda n: chat(http, n, max_tokens=8).status_code, names))
    stop.set()
    watcher.join()
    assert codes == [200] * len(names)
    assert 0 < peak["estimate"] <= budget
    assert 0 < peak["measured"] <= budget
    assert manager.evictions >= 2
    assert sum(r.state == State.LOADED for r in manager.residencies()) <= 2


def test_fail_contention_answers_503_with_retry_after(
        three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    models = [{"name": "a", "source": str(three_models[0]), "estimated_memory": "30MiB",
               "pinned": True},
              {"name": "b", "source": str(three_models[1]), "estimated_memory": "30MiB"}]
    reg = write_registry(tmp_path / "m.yaml", models, memory_budget="40MiB", contention="fail")
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        assert chat(http, "a").status_code == 200
        r = chat(http, "b")
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        message = r.json()["error"]["message"]
        assert "40.0 MiB" in message and "a (" in message and "pinned" in message
        assert srv.ctx.manager.get("b").loads == 0


def test_model_larger_than_the_whole_budget_is_507(
        three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    models = [{"name": "huge", "source": str(three_models[0]), "estimated_memory": "1GiB"}]
    reg = write_registry(tmp_path / "m.yaml", models, memory_budget="100MiB")
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        r = chat(http, "huge")
        assert r.status_code == 507
        assert "1.0 GiB" in r.json()["error"]["message"]
        assert "100.0 MiB" in r.json()["error"]["message"]


def test_corrupt_weights_fail_that_model_only(
        three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(three_models[0], broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    models = [{"name": "broken", "source": str(broken)},
              {"name": "good", "source": str(three_models[1])}]
    reg = write_registry(tmp_path / "m.yaml", models)
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        with cf.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: chat(http, "broken"), range(3)))
        for r in results:
            assert r.status_code == 500
            assert "failed to load" in r.json()["error"]["message"]
        assert chat(http, "good").status_code == 200
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert cards["broken"]["state"] == "failed"
        assert cards["broken"]["error"]
        assert srv.ctx.manager.used_bytes() == srv.ctx.manager.get("good").accounted_bytes()


def test_idle_model_is_unloaded_after_its_ttl(
        three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    models = [{"name": "a", "source": str(three_models[0]), "ttl_seconds": 1}]
    reg = write_registry(tmp_path / "m.yaml", models)
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        assert chat(http, "a").status_code == 200
        res = srv.ctx.manager.get("a")
        assert res.state == State.LOADED
        deadline = time.monotonic() + 60  # generous: a loaded 2-core CI machine
        while res.state != State.UNLOADED and time.monotonic() < deadline:
            time.sleep(0.1)
        assert res.state == State.UNLOADED
        assert chat(http, "a").status_code == 200
        assert res.loads == 2


def test_wrong_kind_is_refused_before_any_load(
        three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    from mlxd.models.starter import STARTER_EMBEDDING

    models = [{"name": "chat", "source": str(three_models[0])},
              {"name": "emb", "source": STARTER_EMBEDDING.source}]
    reg = write_registry(tmp_path / "m.yaml", models)
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        r = chat(http, "emb")
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "embedding" in message and "text" in message
        r = http.post("/v1/embeddings", json={"model": "chat", "input": "hello"})
        assert r.status_code in (400, 404)
        if r.status_code == 400:
            assert "text" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": "emb", "prompt": "x"})
        assert r.status_code == 400
        assert srv.ctx.manager.get("emb").loads == 0
        assert srv.ctx.manager.get("chat").loads == 0


def test_unload_calls_the_persist_hook_before_the_engine_stops(
        three_models: list[Path], tmp_path: Path) -> None:
    home = tmp_path / "home"
    cfg = ServerConfig(model=str(three_models[0]), served_model_name="a", home=home,
                       no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        prompt = "persist me " * 40
        assert http.post("/v1/completions", json={"model": "a", "prompt": prompt,
                                                  "max_tokens": 4}).status_code == 200
        engine = srv.ctx.manager.get("a").engine
        calls: list[str] = []
        persist, close = engine.persist_state, engine.close
        engine.persist_state = lambda: (calls.append("persist"), persist())[1]
        engine.close = lambda: (calls.append("close"), close())[1]
        r = http.post("/v1/models/unload", json={"model": "a"})
        assert r.status_code == 200 and r.json()["unloaded"] is True
        assert calls == ["persist", "close"]
        assert list((home / "prefix-cache" / "a").glob("*.safetensors"))


def test_reload_builds_a_fresh_engine_tokenizer_and_parsers(
        three_models: list[Path], agent_model: Path, test_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload re-derives the tokenizer, the reasoning and tool-call parsers and each
    request's detokenizer from the files as they are now (here: a tokenizer swapped on disk
    for one with <think> markers and a Mistral-style template while unloaded)."""
    import mlxd.engines.text.engine as text_engine

    detoks: list[Any] = []

    class RecordingDetokenizer(text_engine.IncrementalDetokenizer):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            detoks.append(self)

    monkeypatch.setattr(text_engine, "IncrementalDetokenizer", RecordingDetokenizer)
    served = shutil.copytree(three_models[0], tmp_path / "model")
    cfg = ServerConfig(model=str(served), served_model_name="a", home=test_home,
                       no_starter=True, enable_prefix_cache_persist=False)
    with running_server(cfg) as srv, srv.client() as http:
        assert chat(http, "a").status_code == 200
        first = srv.ctx.manager.get("a").engine
        assert first.reasoning is None and first.tool_format.name == "hermes"
        assert detoks[-1]._tok is first.tokenizer
        old = (first, first.tokenizer, first.inputs, first.inputs.grammar_tokenizer, detoks[-1])
        assert http.post("/v1/models/unload", json={"model": "a"}).status_code == 200
        for name in ("tokenizer.json", "special_tokens_map.json"):
            shutil.copy(agent_model / name, served / name)
        tok_cfg = json.loads((agent_model / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] += "{# [TOOL_CALLS] #}"
        (served / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        assert http.post("/v1/models/load", json={"model": "a"}).status_code == 200
        assert chat(http, "a").status_code == 200
        second = srv.ctx.manager.get("a").engine
        new = (second, second.tokenizer, second.inputs, second.inputs.grammar_tokenizer,
               detoks[-1])
        assert all(a is not b for a, b in zip(old, new))
        assert detoks[-1]._tok is second.tokenizer  # this request decodes with the new one
        assert second.reasoning is not None and second.reasoning.start == "<think>"
        assert second.tool_format.name == "mistral"


def test_unload_without_wait_is_409_while_in_use_and_waits_by_default(
        smollm2: Path, test_home: Path) -> None:
    cfg = ServerConfig(model=str(smollm2), served_model_name="s", home=test_home,
                       no_starter=True)
    body = {"model": "s", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 30, "stream": True}
    with running_server(cfg) as srv, srv.client() as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(lines)
            r = http.post("/v1/models/unload", json={"model": "s", "wait": False})
            assert r.status_code == 409
            with cf.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(http.post, "/v1/models/unload", json={"model": "s"})
                res = srv.ctx.manager.get("s")
                deadline = time.monotonic() + 60
                while not res.draining and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert res.draining  # the unload has arrived...
                assert not pending.done()  # ...and waits for the stream
                text = "".join(lines)
                assert "[DONE]" in text
                assert pending.result(timeout=30).json()["unloaded"] is True


@pytest.mark.slow
def test_streaming_request_keeps_its_model_past_ttl_and_through_eviction(
        smollm2: Path, three_models: list[Path], tmp_path: Path, test_home: Path) -> None:
    models = [{"name": "s", "source": str(smollm2), "ttl_seconds": 1,
               "estimated_memory": "700MiB"},
              {"name": "other", "source": str(three_models[0]), "estimated_memory": "700MiB"}]
    reg = write_registry(tmp_path / "m.yaml", models, memory_budget="1GiB", contention="fail")
    cfg = ServerConfig(models_config=reg, home=test_home, no_starter=True)
    body = {"model": "s", "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 2000, "stream": True}
    with running_server(cfg) as srv, srv.client() as http:
        res = srv.ctx.manager.get("s")
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(lines)
            time.sleep(2.5)  # > ttl, the reaper has looked at it
            assert res.state == State.LOADED
            r = chat(http, "other")  # needs s evicted: refused, s in use
            assert r.status_code == 503
            assert res.state == State.LOADED
            for _ in range(3):
                assert next(lines) is not None
        deadline = time.monotonic() + 60
        while res.state != State.UNLOADED and time.monotonic() < deadline:
            time.sleep(0.1)
        assert res.state == State.UNLOADED  # released, then unloaded by the TTL
