"""One output-length rule for every API (``mlxd/generation/output_length.py``).

No limit in the request: the rest of the context (or ``--max-tokens`` when the
server sets one). A limit larger than what the prompt leaves: capped to it.
Only a prompt that alone fills the context is refused. Checked through the real
openai and anthropic SDKs on OpenAI chat, completions, Responses and Anthropic
Messages, with replies scripted longer than the context
(``tests/helpers/scripted_engine.py``), so every generation ends where the rule says.

The last part checks the rest of a registry entry's serving defaults (sampling values,
chat template kwargs) the same way: filled in once, from the leased entry, on every API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from mlxd.config import ServerConfig
from mlxd.generation.params import GenerationRequest, SamplingParams
from mlxd.models.spec import ServingDefaults
from mlxd.server.request_policy import apply_serving_defaults, sampling_choices
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


# -- a registry entry's serving defaults, resolved once for every API -------------------
# One server from a registry file: the entry sets max_tokens, sampling defaults (top_k 1
# at temperature 1.0: greedy) and chat_template_kwargs, and is reached by its name, a
# glob alias and a LoRA adapter. The request policy (``server/request_policy.py``) fills
# in what a request leaves out from the entry it leased, under the lease.

REGISTRY_DEFAULTS = ("{max_tokens: 6, temperature: 1.0, top_k: 1, top_p: 0.5, "
                     "chat_template_kwargs: {enable_thinking: false}}")
NAMES = ["agent", "house-anything", "agent-lora"]  # the name, a glob alias, an adapter
NO_THINKING = "<think>\n\n</think>\n"  # what enable_thinking: false renders
HI: list[Any] = [{"role": "user", "content": "Tell me a story"}]


def write_adapter(folder: Path, base: Path) -> Path:
    """A random rank-4 LoRA adapter of ``base``'s last q_proj, in mlx-lm's format."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    layer = json.loads((base / "config.json").read_text())["num_hidden_layers"] - 1
    mx.random.seed(3)
    path = f"model.layers.{layer}.self_attn.q_proj"
    mx.save_safetensors(str(folder / "adapters.safetensors"), {
        f"{path}.lora_a": mx.random.normal((hidden, 4)) * 0.1,
        f"{path}.lora_b": mx.random.normal((4, hidden)) * 0.1})
    (folder / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 1,
        "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0,
                            "keys": ["self_attn.q_proj"]}}))
    return folder


@pytest.fixture(scope="module")
def registry_server(agent_model: Path, test_home: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[RunningServer, ScriptedLoader]]:
    root = tmp_path_factory.mktemp("registry")
    adapter = write_adapter(root / "lora", agent_model)
    registry = root / "models.yaml"
    registry.write_text(f"models:\n  - name: {MODEL}\n    source: {agent_model}\n"
                        "    kind: text\n    aliases: ['house-*']\n"
                        f"    adapters: {{agent-lora: {adapter}}}\n"
                        f"    defaults: {REGISTRY_DEFAULTS}\n")
    cfg = ServerConfig(models_config=registry, home=test_home, no_starter=True,
                       max_context=CONTEXT, max_tokens=9, enable_prefix_cache_persist=False)
    loader = ScriptedLoader(cfg)
    with running_server(cfg, loader=loader) as srv:
        yield srv, loader


@pytest.fixture
def registry(registry_server: tuple[RunningServer, ScriptedLoader]
             ) -> Iterator[tuple[RunningServer, ScriptedLoader]]:
    """The registry server, generating for real unless a test scripts the reply."""
    registry_server[1].reply = None
    yield registry_server
    registry_server[1].reply = None


def test_a_registry_default_is_the_default_for_every_api(
        registry: tuple[RunningServer, ScriptedLoader]) -> None:
    """A model's ``defaults.max_tokens`` bounds a request that gives no limit, on every
    API (OpenAI chat, completions, Responses, Ollama), ahead of ``--max-tokens``: the
    request policy fills it in once (``server/request_policy.py``)."""
    srv, loader = registry
    loader.reply = LONG
    oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    for api, (call, _, length) in OPENAI_APIS.items():
        assert call(oai)[::2] == (length, 6), api
    r = httpx.post(srv.url + "/api/chat", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": False})
    assert r.status_code == 200, r.text
    assert (r.json()["done_reason"], r.json()["eval_count"]) == ("length", 6)


def answers(srv: RunningServer, name: str, **sampling: Any) -> dict[str, str]:
    """The reply of ``name`` to one prompt on each text API, with these sampling values
    (OpenAI's names; each API gets its own spelling of them)."""
    oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model=name, messages=HI, **sampling)
    completion = oai.completions.create(model=name, prompt="Once upon a time", **sampling)
    response = oai.responses.create(model=name, input="Tell me a story", **sampling)
    # this SDK no longer spells temperature / top_p / top_k; the API still takes them
    message = claude.messages.create(model=name, max_tokens=6, messages=HI,
                                     extra_body=sampling)
    ollama = httpx.post(srv.url + "/api/chat", timeout=60, json={
        "model": name, "messages": HI, "stream": False, "options": sampling})
    assert ollama.status_code == 200, ollama.text
    return {"chat": str(chat.choices[0].message.content),
            "completions": completion.choices[0].text,
            "responses": response.output_text,
            "anthropic": "".join(getattr(b, "text", "") for b in message.content),
            "ollama": ollama.json()["message"]["content"]}


@pytest.mark.parametrize("name", NAMES)
def test_registry_sampling_defaults_apply_on_every_api_and_name(
        registry: tuple[RunningServer, ScriptedLoader], name: str) -> None:
    """The entry's top_k 1 makes a request that names no sampling values greedy (its
    temperature 1.0 would sample otherwise), on every API, whether the request names the
    model, a glob alias of it or one of its LoRA adapters."""
    srv, _ = registry
    greedy = answers(srv, name, temperature=0.0)
    assert all(greedy.values()), greedy
    assert answers(srv, name) == greedy


def test_a_client_sampling_value_overrides_the_registry_default(
        registry: tuple[RunningServer, ScriptedLoader]) -> None:
    srv, _ = registry
    oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    def reply(**kw: Any) -> str:
        r = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, **kw)
        return str(r.choices[0].message.content)

    # top_k -1 (off) and top_p 1.0 leave the entry's temperature 1.0 to sample
    assert reply(seed=5, extra_body={"top_k": -1}, top_p=1.0) != reply(temperature=0.0)
    # the Responses object echoes what the request ran with: the entry's, or the client's
    r = oai.responses.create(model="house-anything", input="hi", max_output_tokens=2)
    assert (r.temperature, r.top_p) == (1.0, 0.5)
    r = oai.responses.create(model="agent-lora", input="hi", max_output_tokens=2,
                             temperature=0.25, top_p=0.9)
    assert (r.temperature, r.top_p) == (0.25, 0.9)


def test_registry_chat_template_kwargs_go_under_the_clients(
        registry: tuple[RunningServer, ScriptedLoader]) -> None:
    """The entry's ``enable_thinking: false`` reaches the template on every API (and for
    an alias and an adapter); a client's own kwargs are merged over it, key by key."""
    srv, loader = registry
    loader.reply = "ok"
    oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    for name in NAMES:
        oai.chat.completions.create(model=name, messages=HI)
        assert loader.last_prompt.endswith(NO_THINKING), name
    oai.responses.create(model=MODEL, input="hi")
    assert loader.last_prompt.endswith(NO_THINKING)
    claude.messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert loader.last_prompt.endswith(NO_THINKING)
    r = httpx.post(srv.url + "/api/chat", timeout=60,
                   json={"model": MODEL, "messages": HI, "stream": False})
    assert r.status_code == 200, r.text
    assert loader.last_prompt.endswith(NO_THINKING)
    # other kwargs of the client's keep the entry's; the client's enable_thinking wins
    oai.chat.completions.create(model=MODEL, messages=HI,
                                extra_body={"chat_template_kwargs": {"unused": 1}})
    assert loader.last_prompt.endswith(NO_THINKING)
    oai.chat.completions.create(model=MODEL, messages=HI,
                                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert loader.last_prompt.endswith("<|im_start|>assistant\n")
    oai.responses.create(model="agent-lora", input="hi", reasoning={"effort": "high"})
    assert loader.last_prompt.endswith("<|im_start|>assistant\n")


def test_apply_serving_defaults_resolves_the_clients_choices() -> None:
    """The resolver itself: the client's values, else the entry's, else OpenAI's; a
    request built with final ``SamplingParams`` (no choices) is left as it is."""
    defaults = ServingDefaults(temperature=0.3, top_p=0.5, top_k=-1, min_p=0.1,
                               repetition_penalty=1.1, max_tokens=5,
                               chat_template_kwargs={"a": 1, "b": 1})
    config = ServerConfig(max_tokens=9)
    request = GenerationRequest(prompt="x", chat_template_kwargs={"a": 2},
                                sampling_choices=sampling_choices(top_p=0.9, seed=4))
    apply_serving_defaults(request, defaults, config)
    assert request.sampling == SamplingParams(temperature=0.3, top_p=0.9, top_k=0, min_p=0.1,
                                              seed=4, repetition_penalty=1.1)
    assert (request.chat_template_kwargs, request.max_tokens) == ({"a": 2, "b": 1}, 5)
    final = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0.0))
    apply_serving_defaults(final, defaults, config)
    assert final.sampling == SamplingParams(temperature=0.0)
    assert sampling_choices().temperature is None  # not given stays not given
