"""The prefix cache keys KV states by media hashes, cache salt and model identity too.

A vision model's prompt holds the same placeholder tokens whatever the image:
two requests with different images must never share cached KV state, and the
same image must. Shown on ``PrefixCache`` with real KV caches from a tiny
model, and through the real scheduler of a served text model with prepared
prompts that carry media items (a text model's input processor never makes
them; the scheduler and cache treat them the same as a vision engine's).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.config import ServerConfig
from mlxd.engines.text.input_processor import MediaItem
from mlxd.engines.text.prefix_cache import PrefixCache
from mlxd.generation.events import Finish
from mlxd.generation.params import GenerationRequest, SamplingParams
from tests.helpers.server import RunningServer, running_server

IMAGE_A = MediaItem.from_bytes("image", b"\x89PNG first picture")
IMAGE_B = MediaItem.from_bytes("image", b"\x89PNG second picture")
PLACEHOLDER = 7  # stands for the image tokens a vision processor would insert


def _kv_state(model: Any, tokens: list[int]) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.fixture(scope="module")
def tiny_lm(tiny_model: Path) -> Any:
    from mlx_lm.utils import load

    model, _tokenizer = load(str(tiny_model))[:2]
    return model


def test_different_images_behind_the_same_tokens_never_share_kv(tiny_lm: Any,
                                                                 tmp_path: Path) -> None:
    tokens = [1, 40, 41, *([PLACEHOLDER] * 16), 42, 43, 44]
    longer = [*tokens, 45, 46]
    cache = PrefixCache(64 * 2**20, identity="model-1")
    ns_a, ns_b = cache.namespace((IMAGE_A.sha256,)), cache.namespace((IMAGE_B.sha256,))
    cache.insert(tokens, _kv_state(tiny_lm, tokens), ns_a)

    assert cache.fetch(longer, ns_b) == (None, 0)  # another image: cold
    assert cache.fetch(longer)[1] == 0  # the same tokens with no image: cold
    assert cache.fetch(longer, cache.namespace((IMAGE_A.sha256,), salt="tenant-2"))[1] == 0
    hit, n_cached = cache.fetch(longer, ns_a)  # the same image: warm
    assert hit is not None and n_cached == len(tokens)
    # The namespace is per model too: another identity never names the same entries.
    assert PrefixCache(1, identity="model-2").namespace((IMAGE_A.sha256,)) != ns_a

    # Saved and restored, each entry keeps its namespace.
    cache.save(tmp_path / "pc")
    restored = PrefixCache(64 * 2**20, identity="model-1")
    assert restored.restore(tmp_path / "pc") == 1
    assert restored.fetch(longer, ns_b) == (None, 0)
    assert restored.fetch(longer, ns_a)[1] == len(tokens)


@pytest.fixture(scope="module")
def cache_server(tiny_model_b: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RunningServer]:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m",
                       home=tmp_path_factory.mktemp("media-home"), no_starter=True,
                       prefix_cache_bytes=64 * 2**20, enable_prefix_cache_persist=False)
    with running_server(cfg) as srv, srv.client() as http:
        assert http.post("/v1/models/load", json={"model": "m"}).status_code == 200
        yield srv


def test_the_scheduler_keys_cached_prompts_by_their_media(cache_server: RunningServer) -> None:
    engine = cache_server.ctx.manager.get("m").engine
    prompt = "Describe the picture. " + " ".join(f"detail {i}" for i in range(60))

    async def cached_tokens(media: tuple[MediaItem, ...], salt: str | None = None) -> int:
        prepared = await engine.prepare(GenerationRequest(
            prompt=prompt, max_tokens=2, sampling=SamplingParams(temperature=0)))
        finish = None
        async for event in engine.generate(replace(prepared, media=media, cache_salt=salt)):
            finish = event if isinstance(event, Finish) else finish
        assert finish is not None and finish.reason in ("length", "stop")
        return finish.usage.cached_tokens

    async def main() -> list[int]:
        return [await cached_tokens((IMAGE_A,)),
                await cached_tokens((IMAGE_B,)),
                await cached_tokens((IMAGE_A,), salt="tenant-2"),
                await cached_tokens(()),
                await cached_tokens((IMAGE_A,)),
                await cached_tokens((IMAGE_B,))]

    first_a, first_b, salted_a, text_only, again_a, again_b = asyncio.run(main())
    assert [first_a, first_b, salted_a, text_only] == [0, 0, 0, 0]
    assert again_a > 60 and again_b > 60  # the same image (and salt) shares


def _cached(http: Any, prompt: str, **extra: Any) -> int:
    resp = http.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
        "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_requests_share_cached_kv_only_under_the_same_cache_salt(
        cache_server: RunningServer) -> None:
    prompt = "a prompt long enough to be worth caching " * 12 + uuid.uuid4().hex
    with cache_server.client() as http:
        assert _cached(http, prompt, cache_salt="tenant-a") == 0
        assert _cached(http, prompt, cache_salt="tenant-a") > 60  # same salt: shared
        assert _cached(http, prompt, cache_salt="tenant-b") == 0  # another tenant: not
        assert _cached(http, prompt) == 0  # unsalted requests do not see salted entries
        resp = http.post("/v1/completions", json={"model": "m", "prompt": prompt,
                                                  "max_tokens": 2, "cache_salt": "tenant-c"})
        assert resp.status_code == 200
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_cache_salt_must_be_a_short_nonempty_string(cache_server: RunningServer,
                                                    salt: Any) -> None:
    with cache_server.client() as http:
        resp = http.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "cache_salt": salt})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "cache_salt"
