"""Prompt-caching hints keep a prefix resident ahead of LRU eviction.

Anthropic ``cache_control`` pins the marked prefix for its TTL and ``usage``
reports cache writes and reads as Anthropic does; OpenAI's ``prompt_cache_key``
pins a key's prompt for the next request of that key. A real tiny model with
a prefix cache small enough that a handful of other prompts evicts everything
unpinned: without the pin, the second request finds nothing cached.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from openai import OpenAI

from mlxd.config import ServerConfig
from mlxd.engines.text.prefix_cache import PrefixCache
from tests.helpers.server import RunningServer, running_server

MODEL = "tiny"
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise." for i in range(40))
# ~1 KiB of KV per token for the tiny model: pins hold up to 1.5 MiB, a flood of 12
# prompts of ~350 tokens evicts the rest
CACHE_BYTES = 3 * 2**20


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RunningServer]:
    cfg = ServerConfig(model=str(tiny_model), served_model_name=MODEL, no_starter=True,
                       home=tmp_path_factory.mktemp("cache-home"),
                       prefix_cache_bytes=CACHE_BYTES, enable_prefix_cache_persist=False)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def flood(server: RunningServer, n: int = 12) -> None:
    """Unrelated long prompts: enough to evict every unpinned entry."""
    with server.client() as http:
        for i in range(n):
            text = f"Unrelated {i}. " + " ".join(f"item{i}_{j}" for j in range(120))
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text


def ask(claude: anthropic.Anthropic, question: str, *, ttl: str | None = "5m",
        **kw: Any) -> Any:
    control: dict[str, Any] = {"type": "ephemeral"}
    if ttl is not None:
        control["ttl"] = ttl
    return claude.messages.create(
        model=MODEL, max_tokens=1,
        system=[{"type": "text", "text": SYSTEM, "cache_control": control}],
        messages=[{"role": "user", "content": question}], **kw)


def total(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_creation_input_tokens
               + usage.cache_read_input_tokens)


def test_marked_system_prompt_survives_eviction(claude: anthropic.Anthropic,
                                                server: RunningServer) -> None:
    first = ask(claude, "First question?")
    written = first.usage.cache_creation_input_tokens
    assert written > 100 and first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == written
    flood(server)
    second = ask(claude, "A different second question?")
    # the marked prefix comes from the cache; nothing new is written
    assert second.usage.cache_read_input_tokens >= written
    assert second.usage.cache_creation_input_tokens == 0
    assert total(second.usage) == claude.messages.count_tokens(
        model=MODEL, system=SYSTEM,
        messages=[{"role": "user", "content": "A different second question?"}]).input_tokens


def test_unmarked_prompt_is_evicted(claude: anthropic.Anthropic, server: RunningServer) -> None:
    """The control: the same scenario without a mark reads nothing back."""
    system = "Another long system prompt. " + " ".join(f"Law {i}: be kind." for i in range(40))

    def plain(question: str) -> Any:
        return claude.messages.create(model=MODEL, max_tokens=1, system=system,
                                      messages=[{"role": "user", "content": question}])

    first = plain("One?")
    assert first.usage.cache_creation_input_tokens == 0
    flood(server)
    # (at most the chat template's first tokens, which every prompt shares)
    assert plain("Two?").usage.cache_read_input_tokens < 16


def test_one_hour_ttl_is_reported_as_such(claude: anthropic.Anthropic) -> None:
    system = "A third long system prompt. " + " ".join(f"Tip {i}: be brief." for i in range(40))
    r = claude.messages.create(
        model=MODEL, max_tokens=1,
        system=[{"type": "text", "text": system,
                 "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": "Q?"}])
    assert r.usage.cache_creation.ephemeral_1h_input_tokens == \
        r.usage.cache_creation_input_tokens > 100


def test_marked_message_pins_the_conversation(claude: anthropic.Anthropic,
                                              server: RunningServer) -> None:
    history = [{"role": "user", "content": [
        {"type": "text", "text": "Remember: " + " ".join(f"fact{i}" for i in range(150)),
         "cache_control": {"type": "ephemeral"}}]},
               {"role": "assistant", "content": "Noted."}]
    first = claude.messages.create(model=MODEL, max_tokens=1,
                                   messages=[*history, {"role": "user", "content": "One?"}])
    assert first.usage.cache_creation_input_tokens > 150
    flood(server)
    second = claude.messages.create(model=MODEL, max_tokens=1,
                                    messages=[*history, {"role": "user", "content": "Two?"}])
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens


def test_streaming_usage_counts_the_cache(claude: anthropic.Anthropic) -> None:
    ask(claude, "Warm it up?")
    with claude.messages.stream(
            model=MODEL, max_tokens=2,
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Streamed?"}]) as stream:
        start = None
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage
        final = stream.get_final_message().usage
    assert start is not None and start.cache_read_input_tokens > 100
    assert start.cache_read_input_tokens == final.cache_read_input_tokens
    assert start.input_tokens == final.input_tokens
    assert final.cache_creation_input_tokens == 0


@pytest.mark.parametrize(("control", "param"), [
    ({"type": "ephemeral", "ttl": "2h"}, "ttl"),
    ({"type": "ephemeral", "ttl": 300}, "ttl"),
    ({"type": "ephemeral", "ttl": ""}, "ttl"),
    ({"type": "persistent"}, "cache_control"),
    ("ephemeral", "cache_control"),
    ({}, "cache_control"),
], ids=["2h", "number", "empty", "unknown type", "a string", "empty object"])
def test_bad_cache_control_is_a_400(server: RunningServer, control: Any, param: str) -> None:
    with server.client() as http:
        r = http.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": control}]}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].cache_control" in body["error"]["message"]
    assert param in body["error"]["message"]


def test_marks_on_tools_and_top_level_are_accepted(claude: anthropic.Anthropic) -> None:
    tool = {"name": "lookup", "description": "Look something up.",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"}}
    r = claude.messages.create(model=MODEL, max_tokens=1, tools=[tool],
                               messages=[{"role": "user", "content": "hi"}],
                               extra_body={"cache_control": {"type": "ephemeral"}})
    # the top-level mark covers every message: only the turn's opening is left over
    assert r.usage.cache_creation_input_tokens > 100 and r.usage.input_tokens < 10
    assert total(r.usage) == claude.messages.count_tokens(
        model=MODEL, tools=[tool], messages=[{"role": "user", "content": "hi"}]).input_tokens


# -- prompt_cache_key (Responses) ------------------------------------------------------

def test_prompt_cache_key_keeps_the_conversation_resident(oai: OpenAI,
                                                          server: RunningServer) -> None:
    base = [{"role": "developer", "content": SYSTEM.replace("careful", "coding")},
            {"role": "user", "content": "Start the task."}]
    first = oai.responses.create(model=MODEL, input=base, max_output_tokens=1, temperature=0,
                                 prompt_cache_key="thread-1")
    flood(server)
    follow = [*base, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "Next step."}]
    keyed = oai.responses.create(model=MODEL, input=follow, max_output_tokens=1,
                                 temperature=0, prompt_cache_key="thread-1")
    assert keyed.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 8

    # the control: the same conversation shape under no key is evicted by the flood
    other = [{"role": "developer", "content": SYSTEM.replace("careful", "tidy")},
             {"role": "user", "content": "Start the task."}]
    oai.responses.create(model=MODEL, input=other, max_output_tokens=1, temperature=0)
    flood(server)
    plain = oai.responses.create(model=MODEL, input=[*other, *follow[2:]], max_output_tokens=1,
                                 temperature=0)
    assert plain.usage.input_tokens_details.cached_tokens < 16


# -- the pins themselves -------------------------------------------------------------

def kv(n: int) -> list[Any]:
    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    return [layer]


def test_a_pin_expires_after_its_ttl_and_renews_on_use() -> None:
    cache = PrefixCache(max_bytes=2**17)  # the LRU holds three of these states
    tokens = list(range(40))
    cache.pin(tokens[:30], ttl_s=0.5)
    cache.insert(tokens, kv(40))
    for i in range(1, 5):  # evict the unpinned entry, as a flood would
        cache.insert([1000 * i + t for t in range(40)], kv(40))
    state, n = cache.fetch([*tokens[:30], 99])
    assert state is not None and n == 30 and state[0].offset == 30
    assert cache.pinned_bytes == 30 * 2 * 8 * 4 * 2  # only the prefix is held
    time.sleep(0.3)
    assert cache.fetch([*tokens[:30], 98])[1] == 30  # used: renewed for another 0.5 s
    time.sleep(0.3)
    assert cache.fetch([*tokens[:30], 97])[1] == 30
    time.sleep(0.6)
    assert cache.fetch([*tokens[:30], 96]) == (None, 0)
    assert cache.pinned_bytes == 0


def test_pins_take_at_most_half_the_cache() -> None:
    cache = PrefixCache(max_bytes=2 * 2 * 40 * 2 * 8 * 4 * 2)  # room for four 40-token pins
    for i in range(4):
        tokens = [1000 * i + t for t in range(41)]
        cache.pin(tokens[:40], ttl_s=60 + i)
        cache.insert(tokens, kv(41))
        assert cache.pinned_bytes <= cache.max_pinned_bytes
    assert cache.pinned_bytes == cache.max_pinned_bytes  # two pins
    # the pins closest to expiry went first; the newest is held
    assert cache.fetch([3000 + t for t in range(40)] + [7])[1] == 40
    assert cache.fetch([t for t in range(40)] + [7])[1] == 0
