"""Every media limit is a 4xx in the API's own shape before any model load (issue 11
item 2): the vision model here is a config-only folder that could never load, and
each test checks it was never even tried; a text model refuses media unread."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.models.spec import ModelEntry
from tests.helpers.media_samples import (
    MediaSite,
    bomb_png,
    data_url,
    image_part,
    png,
    servable_vision_engines,
    video,
    video_part,
    vision_folder,
)
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

LIMITS = {"max_image_bytes": 4000, "max_media_bytes": 6000, "max_images_per_request": 2,
          "max_image_pixels": 1_000_000, "max_video_seconds": 1.0}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
        test_home: Path) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("media-limits")
    entries = [ModelEntry(name="vl", source=str(vision_folder(root))),
               ModelEntry(name="tiny", source=str(tiny_model))]
    cfg = registry_config(root / "models.yaml", entries, test_home, **LIMITS)
    with running_server(cfg, engines=servable_vision_engines()) as server:
        yield server


def never_loaded(srv: RunningServer) -> None:
    res = srv.ctx.manager.get("vl")
    assert (str(res.state), res.loads, res.last_error) == ("unloaded", 0, None)
    listed = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
    assert [m["state"] for m in listed if m["id"] == "vl"] == ["unloaded"]


def chat(srv: RunningServer, *parts: dict[str, Any], model: str = "vl") -> httpx.Response:
    content = [{"type": "text", "text": "describe"}, *parts]
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": content}]})


def anthropic(srv: RunningServer, *blocks: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/messages", timeout=30, json={
        "model": "vl", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, *blocks]}]})


def b64_block(data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


P1 = "messages[0].content[1]"


@pytest.mark.parametrize("parts,status,words,param", [
    ([image_part(data_url(png()))] * 3, 400, "3 images; the limit is 2", f"{P1[:-3]}[3].image_url"),
    ([image_part(data_url(b"\0" * 4500))], 400, "larger than 4000 bytes", f"{P1}.image_url"),
    ([image_part(data_url(b"\0" * 3500))] * 2, 413, "exceed 6000 bytes", "messages[0].content[2]"
     ".image_url"),
    ([image_part(data_url(bomb_png()))], 400, "pixels", f"{P1}.image_url"),
    ([image_part(data_url(b"garbage bytes" * 20))], 400, "not an image", f"{P1}.image_url"),
    ([video_part(data_url(video(seconds=2.0, fps=2), "video/mp4"))], 400, "2.0 s long",
     f"{P1}.video_url"),
    ([image_part("http://127.0.0.1:9/cat.png")], 400, "loopback", f"{P1}.image_url"),
])
def test_chat_limits_are_openai_errors_before_any_load(
        srv: RunningServer, parts: list[dict[str, Any]], status: int, words: str,
        param: str) -> None:
    assert_openai_error(chat(srv, *parts), status, words, param=param)
    never_loaded(srv)


def test_anthropic_limits_are_anthropic_errors_before_any_load(srv: RunningServer) -> None:
    r = anthropic(srv, b64_block(b"\0" * 4500))
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "messages[0].content[1].image_url is larger than 4000 bytes."}}
    r = anthropic(srv, b64_block(b"\0" * 3500), b64_block(b"\0" * 3500))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    r = anthropic(srv, {"type": "image", "source": {"type": "url",
                                                    "url": "http://169.254.169.254/x"}})
    assert r.status_code == 400 and "link-local" in r.json()["error"]["message"], r.text
    never_loaded(srv)


def test_responses_input_image_limits_before_any_load(srv: RunningServer) -> None:
    r = httpx.post(f"{srv.url}/v1/responses", timeout=30, json={"model": "vl", "input": [
        {"role": "user", "content": [{"type": "input_image",
                                      "image_url": data_url(bomb_png())}]}]})
    assert_openai_error(r, 400, "pixels", param="messages[0].content[0].image_url")
    never_loaded(srv)


def test_tokenize_applies_the_media_limits_before_any_load(srv: RunningServer) -> None:
    """/tokenize counts a vision model's image tokens through its processor, so its images
    are checked like a chat's first: 3 images over the limit of 2 is a 400, nothing loads."""
    content = [{"type": "text", "text": "describe"}, *[image_part(data_url(png()))] * 3]
    r = httpx.post(f"{srv.url}/tokenize", timeout=30,
                   json={"model": "vl", "messages": [{"role": "user", "content": content}]})
    assert_openai_error(r, 400, "3 images; the limit is 2", param=f"{P1[:-3]}[3].image_url")
    never_loaded(srv)


@pytest.fixture
def site() -> Iterator[MediaSite]:
    s = MediaSite()
    s.routes["/cat.png"] = (200, {"Content-Type": "image/png"}, png())
    yield s
    s.close()


def test_a_text_model_refuses_media_without_fetching_it(srv: RunningServer,
                                                        site: MediaSite) -> None:
    r = chat(srv, image_part(site.url("/cat.png")), model="tiny")
    assert_openai_error(r, 400, "text model and cannot read images")
    r = chat(srv, video_part(site.url("/cat.png")), model="tiny")
    assert_openai_error(r, 400, "cannot read video")
    assert site.seen == []


def test_a_streaming_request_is_refused_before_the_stream_starts(srv: RunningServer) -> None:
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": "vl", "stream": True, "messages": [{"role": "user", "content": [
            image_part(data_url(bomb_png()))]}]})
    assert r.headers["content-type"].startswith("application/json")
    assert_openai_error(r, 400, "pixels", param="messages[0].content[0].image_url")
    never_loaded(srv)
