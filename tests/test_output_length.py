"""One output-length rule for every API (``mlxd/generation/output_length.py``).

No limit in the request: the rest of the context (or ``--max-tokens`` when the
server sets one). A limit larger than what the prompt leaves: capped to it.
Only a prompt that alone fills the context is refused. Checked through the real
openai and anthropic SDKs on OpenAI chat, completions, Responses and Anthropic
Messages, with replies scripted longer than the context
(``tests/helpers/scripted_engine.py``), so every generation ends where the rule says.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from mlxd.config import ServerConfig
from tests.helpers.scripted_engine import ScriptedLoader, scripted_server
from tests.helpers.server import RunningServer, running_server

CONTEXT = 700  # more than the old default of 512 output tokens
LONG = " ".join(f"w{i}" for i in range(2000))  # far more tokens than the context holds
MODEL = "agent"


@pytest.fixture(scope="module")
def server(agent_model: Path, test_home: Path) -> Iterator[tuple[RunningServer, ScriptedLoader]]:
    with scripted_server(agent_model, test_home, MODEL, max_context=CONTEXT,
                         enable_prefix_cache_persist=False) as pair:
        pair[1].reply = LONG
        yield pair


@pytest.fixture(scope="module")
def oai(server: tuple[RunningServer, ScriptedLoader]) -> OpenAI:
    return OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: tuple[RunningServer, ScriptedLoader]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0].url, api_key="unused", max_retries=0)


def chat(oai: OpenAI, **kw: Any) -> tuple[str, int, int]:
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                    **kw)
    assert r.usage is not None
    return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens


def completion(oai: OpenAI, **kw: Any) -> tuple[str, int, int]:
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", **kw)
    assert r.usage is not None
    return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens


def responses(oai: OpenAI, **kw: Any) -> tuple[str, int, int]:
    r = oai.responses.create(model=MODEL, input="go", **kw)
    assert r.usage is not None
    reason = r.incomplete_details.reason if r.incomplete_details else r.status
    return str(reason), r.usage.input_tokens, r.usage.output_tokens


OPENAI_APIS = {"chat": (chat, "max_tokens", "length"),
               "completions": (completion, "max_tokens", "length"),
               "responses": (responses, "max_output_tokens", "max_output_tokens")}


@pytest.mark.parametrize("api", list(OPENAI_APIS))
def test_no_limit_means_the_rest_of_the_context(oai: OpenAI, api: str) -> None:
    call, _, length = OPENAI_APIS[api]
    reason, prompt, completion_tokens = call(oai)
    assert reason == length
    assert prompt + completion_tokens == CONTEXT and completion_tokens > 512


@pytest.mark.parametrize("api", list(OPENAI_APIS))
def test_a_limit_beyond_the_context_is_capped(oai: OpenAI, api: str) -> None:
    call, field, length = OPENAI_APIS[api]
    reason, prompt, completion_tokens = call(oai, **{field: 100_000})
    assert reason == length and prompt + completion_tokens == CONTEXT


@pytest.mark.parametrize("api", list(OPENAI_APIS))
def test_a_limit_inside_the_context_is_kept(oai: OpenAI, api: str) -> None:
    call, field, length = OPENAI_APIS[api]
    assert call(oai, **{field: 9})[::2] == (length, 9)


@pytest.mark.parametrize("api", list(OPENAI_APIS))
def test_a_prompt_that_fills_the_context_is_a_400(oai: OpenAI, api: str) -> None:
    long_prompt = "hello " * (CONTEXT * 2)
    with pytest.raises(openai.BadRequestError) as exc:
        if api == "chat":
            oai.chat.completions.create(model=MODEL, max_tokens=5,
                                        messages=[{"role": "user", "content": long_prompt}])
        elif api == "completions":
            oai.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
        else:
            oai.responses.create(model=MODEL, input=long_prompt, max_output_tokens=5)
    assert exc.value.code == "context_length_exceeded"


def test_anthropic_max_tokens_beyond_the_context_is_capped(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=20_000,
                               messages=[{"role": "user", "content": "go"}])
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.output_tokens == CONTEXT


def test_anthropic_max_tokens_inside_the_context_is_kept(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=9,
                               messages=[{"role": "user", "content": "go"}])
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 9)


def test_anthropic_prompt_that_fills_the_context_is_a_400(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "hello " * (CONTEXT * 2)}])


def test_a_reply_shorter_than_the_room_ends_by_itself(
        oai: OpenAI, server: tuple[RunningServer, ScriptedLoader]) -> None:
    server[1].reply = "short answer"
    try:
        assert chat(oai)[0] == "stop"
        assert responses(oai)[0] == "completed"
    finally:
        server[1].reply = LONG


def test_server_max_tokens_is_the_default_when_set(agent_model: Path, test_home: Path) -> None:
    with scripted_server(agent_model, test_home, MODEL, max_context=CONTEXT, max_tokens=7,
                         enable_prefix_cache_persist=False) as (srv, loader):
        loader.reply = LONG
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for api, (call, field, length) in OPENAI_APIS.items():
            assert call(oai)[::2] == (length, 7), api
            # a request's own limit still wins, capped to the context
            _, prompt, completion_tokens = call(oai, **{field: 100_000})
            assert prompt + completion_tokens == CONTEXT, api


def test_a_registry_default_is_the_default_for_every_api(agent_model: Path, test_home: Path,
                                                         tmp_path: Path) -> None:
    """A model's ``defaults.max_tokens`` bounds a request that gives no limit, on every
    API (OpenAI chat, completions, Responses, Ollama), ahead of ``--max-tokens``: the
    request policy fills it in once (``server/request_policy.py``)."""
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  - name: {MODEL}\n    source: {agent_model}\n"
                        "    kind: text\n    defaults: {max_tokens: 6}\n")
    cfg = ServerConfig(models_config=registry, home=test_home, no_starter=True,
                       max_context=CONTEXT, max_tokens=9, enable_prefix_cache_persist=False)
    loader = ScriptedLoader(cfg)
    loader.reply = LONG
    with running_server(cfg, loader=loader) as srv:
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for api, (call, _, length) in OPENAI_APIS.items():
            assert call(oai)[::2] == (length, 6), api
        r = httpx.post(srv.url + "/api/chat", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": False})
        assert r.status_code == 200, r.text
        assert (r.json()["done_reason"], r.json()["eval_count"]) == ("length", 6)
