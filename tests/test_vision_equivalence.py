"""One image, three APIs, one pipeline (issue 11): an OpenAI ``image_url`` part, an
Anthropic ``image`` block (base64 or url source) and a Responses ``input_image`` (data:
or http URL) resolve to the same media and the same canonical messages, and a real
vision model answers all of them alike through the openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlxd.media.limits import MediaLimits
from mlxd.media.resolve import resolve_media
from mlxd.protocol.anthropic import MessagesRequest
from mlxd.protocol.responses import ResponsesRequest
from mlxd.server.anthropic_input import canonical_messages
from mlxd.server.responses_input import input_messages
from tests.helpers.media_samples import MediaSite, data_url, png

QUESTION = "What colour is this image?"
LOOPBACK_OK = replace(MediaLimits(), allow_private_urls=True)
COLOURS = [(220, 30, 30), (30, 50, 220)]


@pytest.fixture(scope="module")
def site() -> Iterator[MediaSite]:
    s = MediaSite()
    for i, rgb in enumerate(COLOURS):
        s.routes[f"/{i}.png"] = (200, {"Content-Type": "image/png"}, png(64, 64, rgb))
    yield s
    s.close()


def openai_messages(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def anthropic_prompt_tokens(usage: Any) -> int:
    """All prompt tokens of an Anthropic usage: its ``input_tokens`` leave out the ones read
    from the prefix cache (a repeated image prompt hits it)."""
    return int(usage.input_tokens) + int(usage.cache_read_input_tokens or 0)


def anthropic_content(source: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]


def anthropic_source(site: MediaSite, i: int, remote: bool) -> dict[str, Any]:
    if remote:
        return {"type": "url", "url": site.url(f"/{i}.png")}
    return {"type": "base64", "media_type": "image/png",
            "data": base64.b64encode(site.routes[f"/{i}.png"][2]).decode()}


def responses_input(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": QUESTION}]}]


def image_url(site: MediaSite, i: int, remote: bool) -> str:
    return site.url(f"/{i}.png") if remote else data_url(site.routes[f"/{i}.png"][2])


def canonical(site: MediaSite, i: int, remote: bool) -> dict[str, list[dict[str, Any]]]:
    """The canonical messages each API's adapter makes of the same image and question."""
    anthropic = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": anthropic_content(anthropic_source(site, i, remote))}]})
    responses = ResponsesRequest.model_validate({"model": "m", "input": responses_input(
        image_url(site, i, remote))})
    return {"openai": openai_messages(image_url(site, i, remote)),
            "anthropic": canonical_messages(anthropic),
            "responses": input_messages(responses.input)}


def summary(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What reaches the engine: text parts, and each image by hash, format and size."""
    out: list[tuple[Any, ...]] = []
    for m in messages:
        for part in m["content"]:
            if part["type"] == "image":
                img = part["image"]
                out.append((m["role"], "image", img.sha256, img.format, img.width, img.height))
            else:
                out.append((m["role"], part["type"], part.get("text")))
    return out


@pytest.mark.parametrize("remote", [False, True], ids=["inline", "url"])
def test_every_api_resolves_to_the_same_media_and_messages(site: MediaSite,
                                                           remote: bool) -> None:
    resolved = {api: summary(asyncio.run(resolve_media(messages, LOOPBACK_OK)))
                for api, messages in canonical(site, 0, remote).items()}
    assert resolved["anthropic"] == resolved["openai"] == resolved["responses"]
    assert resolved["openai"][0][1:4] == ("image", __import__("hashlib").sha256(
        site.routes["/0.png"][2]).hexdigest(), "PNG")


# -- end to end: a real tiny qwen2_vl behind each SDK -----------------------------------

@pytest.fixture(scope="module")
def vlm(session_dir: Path, test_home: Path, site: MediaSite) -> Iterator[Any]:
    pytest.importorskip("mlx_vlm")
    from mlxd.models.spec import ModelEntry
    from tests.helpers.retrieval import registry_config
    from tests.helpers.server import running_server
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"  # shared with test_vision_families.py
    folder = build_tiny_vlm("qwen2_vl", root / "qwen2_vl", root / "tokenizers")
    cfg = registry_config(session_dir / "vlm-equivalence.yaml",
                          [ModelEntry(name="vl", source=str(folder))], test_home,
                          allow_private_media_urls=True)  # the site is on 127.0.0.1
    with running_server(cfg) as srv:
        yield srv


def answers(srv: Any, site: MediaSite, i: int, remote: bool) -> dict[str, tuple[str, int]]:
    """(greedy answer, prompt tokens) through each SDK."""
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    ant = anthropic.Anthropic(base_url=srv.url, api_key="x")
    chat = oai.chat.completions.create(model="vl", messages=openai_messages(  # type: ignore[arg-type]
        image_url(site, i, remote)), max_tokens=6, temperature=0)
    msg = ant.messages.create(model="vl", max_tokens=6, messages=[  # type: ignore[misc]
        {"role": "user", "content": anthropic_content(anthropic_source(site, i, remote))}],
        extra_body={"temperature": 0})  # this SDK version no longer takes it as an argument
    resp = oai.responses.create(model="vl", input=responses_input(  # type: ignore[arg-type]
        image_url(site, i, remote)), max_output_tokens=6, temperature=0)
    assert chat.usage is not None and resp.usage is not None
    return {"openai": (chat.choices[0].message.content or "", chat.usage.prompt_tokens),
            "anthropic": ("".join(b.text for b in msg.content if b.type == "text"),
                          anthropic_prompt_tokens(msg.usage)),
            "responses": (resp.output_text, resp.usage.input_tokens)}


def test_every_sdk_gets_the_same_answer_about_the_same_image(vlm: Any, site: MediaSite) -> None:
    seen: dict[str, int] = {}
    for i, remote in ((0, False), (1, False), (0, True)):  # fetched URLs: one colour is enough
        got = answers(vlm, site, i, remote)
        assert got["anthropic"] == got["openai"] == got["responses"], (i, remote, got)
        seen.setdefault(got["openai"][0], i)
    # the image reaches the model through every API: the two colours get different answers
    assert len(seen) == 2, seen


def test_a_video_gets_the_same_answer_through_openai_and_anthropic(vlm: Any) -> None:
    import anthropic
    import openai

    from tests.helpers.media_samples import video

    clip = base64.b64encode(video(seconds=1.0, fps=4, width=56, height=56)).decode()
    oai = openai.OpenAI(base_url=vlm.url + "/v1", api_key="x")
    chat = oai.chat.completions.create(model="vl", max_tokens=6, temperature=0, messages=[{
        "role": "user", "content": [  # type: ignore[list-item, misc]
            {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}},
            {"type": "text", "text": "What happens?"}]}])
    ant = anthropic.Anthropic(base_url=vlm.url, api_key="x")
    msg = ant.messages.create(model="vl", max_tokens=6, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [  # type: ignore[list-item, misc]
            {"type": "video", "source": {"type": "base64", "media_type": "video/mp4",
                                         "data": clip}},
            {"type": "text", "text": "What happens?"}]}])
    text_only = oai.chat.completions.create(model="vl", max_tokens=1, messages=[
        {"role": "user", "content": "What happens?"}])
    assert chat.usage is not None and text_only.usage is not None
    assert anthropic_prompt_tokens(msg.usage) == chat.usage.prompt_tokens \
        > text_only.usage.prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == chat.choices[0].message.content
