"""LoRA adapters added and removed while their base model serves (``POST /v1/models/load``
with ``base`` and ``adapter_path``, ``POST /v1/models/unload``, ``PUT /v1/models``), and
adapters under speculative decoding and structured output. The adapters are the ones
``tests/test_lora.py`` trains with mlx-lm's own trainer (shared through a cache)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.helpers.lora_training import ANSWERS, QUESTION, trained_adapters

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake."}]
STORY_TOKENS = 64


@pytest.fixture(scope="module")
def adapters(smollm2: Path) -> dict[str, Path]:
    return trained_adapters(smollm2)


@pytest.fixture(scope="module")
def server(smollm2: Path, test_home: Path) -> Iterator[Any]:
    """The starter with no adapter at all when it starts: each is added at run time."""
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(model=str(smollm2), served_model_name="smollm2", home=test_home,
                       no_starter=True, enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


def _ask(srv: Any, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 12, **extra}
    with srv.client() as c:
        return c.post("/v1/chat/completions", json=body)


def _answer(srv: Any, model: str, **extra: Any) -> str:
    r = _ask(srv, model, **extra)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _load(srv: Any, name: str, folder: Path | str, base: str = "smollm2") -> httpx.Response:
    with srv.client() as c:
        return c.post("/v1/models/load", json={"model": name, "base": base,
                                               "adapter_path": str(folder)})


def _unload(srv: Any, name: str, wait: bool = True) -> httpx.Response:
    with srv.client() as c:
        return c.post("/v1/models/unload", json={"model": name, "wait": wait})


def _ids(srv: Any) -> set[str]:
    with srv.client() as c:
        return {m["id"] for m in c.get("/v1/models").json()["data"]}


class Stream:
    """A streamed greedy chat answer read on its own thread; ``started`` once its first
    content arrived."""

    def __init__(self, srv: Any, model: str, messages: list[dict[str, str]],
                 max_tokens: int) -> None:
        self.text, self.finish = "", None
        self.error: BaseException | None = None
        self.ended = 0.0  # monotonic time the answer ended
        self.started = threading.Event()
        body = {"model": model, "messages": messages, "temperature": 0,
                "max_tokens": max_tokens, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(srv, body), daemon=True)
        self._thread.start()

    def _run(self, srv: Any, body: dict[str, Any]) -> None:
        try:
            with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.text += choice["delta"].get("content") or ""
                    self.finish = choice.get("finish_reason") or self.finish
                    if self.text:
                        self.started.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.started.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join(300)
        assert not self._thread.is_alive() and self.error is None, self.error


def test_hot_load_and_unload_leave_a_running_stream_untouched(
        server: Any, adapters: dict[str, Path]) -> None:
    undisturbed = Stream(server, "smollm2", STORY, STORY_TOKENS)
    undisturbed.join()
    assert undisturbed.finish == "length"  # a long answer: still running while we load
    stream = Stream(server, "smollm2", STORY, STORY_TOKENS)
    assert stream.started.wait(120)
    r = _load(server, "pelican", adapters["pelican"])
    assert r.status_code == 200, r.text
    assert r.json()["parent"] == "smollm2" and r.json()["adapter"] is True
    assert stream.running  # the adapter was attached while the base streamed
    assert _answer(server, "pelican") == ANSWERS["pelican"]  # joins the running batch
    r = _unload(server, "pelican")
    assert r.status_code == 200 and r.json()["removed"] is True, r.text
    assert stream.running
    gone = _ask(server, "pelican")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    stream.join()
    assert stream.text == undisturbed.text and stream.finish == "length"
    assert "pelican" not in _ids(server)


def test_an_adapter_added_at_run_time_serves_every_api(server: Any,
                                                       adapters: dict[str, Path]) -> None:
    assert _load(server, "kangaroo-all", adapters["kangaroo"]).status_code == 200
    try:
        with server.client() as c:
            base = c.post("/tokenize", json={"model": "smollm2", "prompt": QUESTION}).json()
            mine = c.post("/tokenize", json={"model": "kangaroo-all", "prompt": QUESTION})
            assert mine.status_code == 200 and mine.json()["tokens"] == base["tokens"]
            ollama = c.post("/api/chat", json={
                "model": "kangaroo-all", "stream": False,
                "messages": [{"role": "user", "content": QUESTION}],
                "options": {"temperature": 0, "num_predict": 12}})
            assert ollama.status_code == 200, ollama.text
            assert ollama.json()["message"]["content"] == ANSWERS["kangaroo"]
            anthropic = c.post("/v1/messages", json={
                "model": "kangaroo-all", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTION}]})
            assert anthropic.json()["content"][0]["text"] == ANSWERS["kangaroo"]
            card = c.get("/v1/models/kangaroo-all").json()
            assert card["parent"] == "smollm2" and card["root"] == str(adapters["kangaroo"])
    finally:
        assert _unload(server, "kangaroo-all").status_code == 200


def test_an_unload_waits_for_the_adapters_requests_then_removes_it(
        server: Any, adapters: dict[str, Path]) -> None:
    assert _load(server, "kangaroo", adapters["kangaroo"]).status_code == 200
    stream = Stream(server, "kangaroo", STORY, 48)
    assert stream.started.wait(120)
    busy = _unload(server, "kangaroo", wait=False)
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]
    assert _ask(server, "kangaroo").status_code == 200  # wait=false left it served
    assert stream.running
    done: dict[str, Any] = {}

    def unload() -> None:
        done["r"] = _unload(server, "kangaroo")
        done["at"] = time.monotonic()

    unloader = threading.Thread(target=unload)
    unloader.start()
    for _ in range(200):  # the name goes at once: no new request from here on
        if _ask(server, "kangaroo").status_code == 404:
            break
        time.sleep(0.05)
    assert "kangaroo" not in _ids(server)
    unloader.join(300)
    stream.join()
    assert stream.finish in ("length", "stop") and stream.text  # it finished, whole
    assert done["r"].status_code == 200 and done["r"].json()["removed"] is True
    assert done["at"] >= stream.ended  # the adapter went only after its request ended
    assert _ask(server, "kangaroo").status_code == 404


@pytest.mark.parametrize("case", ["unknown-base", "bad-path", "not-an-adapter", "shadows-model",
                                  "shadows-alias", "twice", "base-is-adapter", "no-path",
                                  "other-architecture"])
def test_a_bad_runtime_adapter_is_a_clear_4xx_and_adds_nothing(
        case: str, server: Any, adapters: dict[str, Path], tmp_path: Path,
        tiny_model: Path) -> None:
    assert _load(server, "held", adapters["pelican"]).status_code == 200
    try:
        before = _ids(server)
        body: dict[str, Any] = {"model": "new", "base": "smollm2",
                                "adapter_path": str(adapters["kangaroo"])}
        status, word = {
            "unknown-base": (404, "does not exist"), "bad-path": (400, "does not exist"),
            "not-an-adapter": (400, "adapter_config.json"),
            "shadows-model": (409, "name of a model"), "shadows-alias": (409, "alias of model"),
            "twice": (409, "name of a LoRA adapter"), "base-is-adapter": (400, "not a base"),
            "no-path": (400, "adapter_path"), "other-architecture": (400, "another"),
        }[case]
        if case == "unknown-base":
            body["base"] = "nope"
        elif case == "bad-path":
            body["adapter_path"] = str(tmp_path / "none")
        elif case == "not-an-adapter":
            body["adapter_path"] = str(tmp_path)
        elif case == "shadows-model":
            body["model"] = "smollm2"
        elif case == "shadows-alias":
            body["model"] = "default"  # the catalog's alias of the served model
        elif case == "twice":
            body["model"] = "held"
        elif case == "base-is-adapter":
            body["base"] = "held"
        elif case == "no-path":
            del body["adapter_path"]
        elif case == "other-architecture":
            body["adapter_path"] = str(adapters["pelican"])
            with server.client() as c:  # a base of another architecture, never loaded
                assert c.put("/v1/models", json={"name": "tiny", "source": str(tiny_model)}
                             ).status_code == 200
            body["base"] = "tiny"
        with server.client() as c:
            r = c.post("/v1/models/load", json=body)
        assert r.status_code == status, r.text
        assert word in r.json()["error"]["message"]
        assert _ids(server) - {"tiny"} == before
        if case == "twice":  # the adapter of that name still serves as before
            assert _answer(server, "held") == ANSWERS["pelican"]
    finally:
        assert _unload(server, "held").status_code == 200
        with server.client() as c:
            c.delete("/v1/models/tiny")


def test_unloading_a_name_that_is_no_adapter_is_refused_or_unloads_the_model(
        server: Any) -> None:
    with server.client() as c:
        r = c.post("/v1/models/unload", json={"model": "nope"})
        assert r.status_code == 404
        r = c.post("/v1/models/unload", json={"model": "smollm2", "adapter_path": "/x"})
        assert r.status_code == 400 and "adapter_path" in r.text


def test_put_adds_and_removes_adapters_without_reloading_the_base(
        server: Any, smollm2: Path, adapters: dict[str, Path]) -> None:
    _answer(server, "smollm2")  # loaded
    with server.client() as c:
        loads = c.get("/v1/models/smollm2").json()["loads"]
        entry = {"name": "smollm2", "source": str(smollm2),
                 "adapters": {"pelican-put": str(adapters["pelican"])}}
        r = c.put("/v1/models", json=entry)
        assert r.status_code == 200 and r.json()["adapters_changed"] is True, r.text
        assert _answer(server, "pelican-put") == ANSWERS["pelican"]
        r = c.put("/v1/models", json={**entry, "adapters": {}})
        assert r.status_code == 200, r.text
        assert _ask(server, "pelican-put").status_code == 404
        assert c.get("/v1/models/smollm2").json()["loads"] == loads  # never reloaded


def test_an_adapter_counts_in_the_budget_while_it_is_loaded(
        server: Any, adapters: dict[str, Path]) -> None:
    from mlxd.models.adapters import read_adapter, stacked_nbytes

    _answer(server, "smollm2")
    res = server.ctx.manager.get("smollm2")
    before_estimate, before_bytes = res.estimate, res.engine.memory_bytes()
    assert _load(server, "pelican-bytes", adapters["pelican"]).status_code == 200
    added = stacked_nbytes([read_adapter(adapters["pelican"])])
    assert res.estimate - before_estimate == added
    assert res.engine.memory_bytes() - before_bytes >= added // 2  # the factors it holds
    assert _unload(server, "pelican-bytes").status_code == 200
    assert res.estimate == before_estimate


def test_structured_output_runs_with_the_adapter(server: Any, adapters: dict[str, Path]) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["word"],
              "properties": {"word": {"type": "string", "maxLength": 20}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    assert _load(server, "pelican-json", adapters["pelican"]).status_code == 200
    try:
        free = _answer(server, "pelican-json")
        assert free == ANSWERS["pelican"]
        doc = _answer(server, "pelican-json", response_format=fmt, max_tokens=40)
        jsonschema.validate(json.loads(doc), schema)
        base = _answer(server, "smollm2", response_format=fmt, max_tokens=40)
        jsonschema.validate(json.loads(base), schema)
    finally:
        assert _unload(server, "pelican-json").status_code == 200


def test_draft_model_speculation_with_an_adapter_equals_plain_decoding(
        server: Any, smollm2: Path, adapters: dict[str, Path], test_home: Path) -> None:
    """The draft model (here the base itself) drafts without the adapter; the adapted
    model verifies every draft, so the greedy answer is the adapter's own."""
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(model=str(smollm2), served_model_name="smollm2", home=test_home,
                       no_starter=True, enable_prefix_cache_persist=False,
                       draft_model=str(smollm2), speculative="draft",
                       adapters=[f"pelican={adapters['pelican']}"])
    assert _load(server, "pelican-plain", adapters["pelican"]).status_code == 200
    try:
        with running_server(cfg) as spec:
            r = _ask(spec, "pelican")
            assert r.status_code == 200, r.text
            with spec.client() as c:
                assert c.get("/v1/models/smollm2").json()["speculative"] == "draft"
            story = _answer(spec, "pelican", messages=STORY, max_tokens=16)
        plain_story = _answer(server, "pelican-plain", messages=STORY, max_tokens=16)
    finally:
        assert _unload(server, "pelican-plain").status_code == 200
    out = r.json()
    assert out["choices"][0]["message"]["content"] == ANSWERS["pelican"]
    details = out["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] > 0  # the base drafts its own answer
    assert story == plain_story
