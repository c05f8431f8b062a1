"""The real openai SDK against a real mlxd server on 127.0.0.1 (tiny random model)."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
from openai import OpenAI

from tests.helpers.server import RunningServer

HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> OpenAI:
    return OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_has_openai_shape(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_default_alias_and_served_name_reach_the_same_model(client: OpenAI) -> None:
    a = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="default", messages=HI, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streaming_chat_concatenates_to_the_non_streaming_answer(client: OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12


def test_completions_with_logprobs_and_echo(client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="def main():", max_tokens=5, temperature=0,
                                  logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith("def main():")
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 5
    assert lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 3 for t in lp.top_logprobs[n_prompt:])
    assert "".join(lp.tokens) == choice.text


def test_chat_logprobs_and_top_logprobs(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_n_choices_are_independent_and_indexed(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, n=3,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 30


def test_seed_makes_sampling_reproducible(client: OpenAI) -> None:
    kw = dict(model="tiny", messages=HI, max_tokens=12, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string_ends_generation(client: OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="import os\n", max_tokens=20,
                                     temperature=0).choices[0].text
    assert len(base) > 4
    stop = base[3:5]
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=20, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_unknown_fields_and_user_are_accepted(client: OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, user="u-1",
                                       extra_body={"some_future_field": {"x": 1}})
    assert r.choices[0].finish_reason == "length"


def test_sixteen_concurrent_requests_all_complete(client: OpenAI) -> None:
    def one(i: int) -> int:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=16, temperature=0)
        return r.usage.completion_tokens
    with cf.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [16] * 16


def test_list_models_shows_kind_and_state(client: OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert "tiny" in models
    extra = models["tiny"].model_extra or {}
    assert extra["kind"] == "text"
    assert extra["state"] in ("loaded", "unloaded")
    assert "default" in extra["aliases"]


@pytest.mark.parametrize("call, exc", [
    (lambda c: c.chat.completions.create(model="nope", messages=HI), openai.NotFoundError),
    (lambda c: c.chat.completions.create(model="tiny", messages=HI * 2000, max_tokens=1),
     openai.BadRequestError),
    (lambda c: c.chat.completions.create(model="tiny", messages=[]), openai.BadRequestError),
    (lambda c: c.chat.completions.create(model="tiny", messages=HI, temperature=5),
     openai.BadRequestError),
    (lambda c: c.completions.create(model="tiny", prompt=""), openai.BadRequestError),
])
def test_sdk_raises_the_right_exception_class(client: OpenAI, call: object, exc: type) -> None:
    with pytest.raises(exc):
        call(client)  # type: ignore[operator]
