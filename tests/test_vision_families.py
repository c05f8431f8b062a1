"""Vision-language serving (issue 11): the six families mlx-vlm runs offline, each a tiny
random-weight model of its real architecture, served over HTTP with an image through the
openai SDK; the image changes the output, and batched equals alone at temperature 0
(requests joining mid-decode included)."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.models.spec import ModelEntry
from tests.helpers.retrieval import registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("mlx_vlm")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "smolvlm", "paligemma"]


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What colour is this image?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def tiny_vlms(session_dir: Path) -> dict[str, Path]:
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"
    return {f: build_tiny_vlm(f, root / f, root / "tokenizers") for f in FAMILIES}


@pytest.fixture(scope="module")
def vlm_server(tiny_vlms: dict[str, Path], session_dir: Path,
               test_home: Path) -> Iterator[RunningServer]:
    entries = [ModelEntry(name=f, source=str(p)) for f, p in tiny_vlms.items()]
    cfg = registry_config(session_dir / "vlm-models.yaml", entries, test_home,
                          max_num_seqs=4)
    with running_server(cfg) as srv:
        yield srv


def first_logprobs(client: Any, model: str, url: str) -> list[float]:
    r = client.chat.completions.create(model=model, messages=image_message(url), max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=5)
    return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]


def answer(client: Any, model: str, url: str, max_tokens: int = 6) -> str:
    r = client.chat.completions.create(model=model, messages=image_message(url),
                                       max_tokens=max_tokens, temperature=0)
    return str(r.choices[0].message.content)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_an_image_that_changes_the_output(vlm_server: RunningServer,
                                                        family: str) -> None:
    import openai

    client = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x")
    red = first_logprobs(client, family, png((220, 30, 30)))
    blue = first_logprobs(client, family, png((30, 50, 220)))
    assert red != blue  # the image reaches the model
    assert red == first_logprobs(client, family, png((220, 30, 30)))  # and deterministically
    card = {m["id"]: m for m in vlm_server.client().get("/v1/models").json()["data"]}[family]
    assert card["kind"] == "vision"  # detected from its vision tower: mlx-vlm, never mlx-lm
    assert card["model_type"] == family


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_with_mid_decode_joins(vlm_server: RunningServer,
                                                    family: str) -> None:
    import openai

    client = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x")
    colours = [(220, 30, 30), (30, 50, 220), (30, 170, 40), (240, 225, 30)]
    urls = [png(c, (56 + 28 * (i % 2), 56)) for i, c in enumerate(colours)]
    alone = [answer(client, family, u, 12) for u in urls]
    together: list[str | None] = [None] * len(urls)
    started = threading.Event()

    def run(i: int) -> None:
        if i >= 2:  # join while the first two are decoding
            started.wait(60)
        with client.chat.completions.create(model=family, messages=image_message(urls[i]),
                                            max_tokens=12, temperature=0, stream=True) as s:
            text = ""
            for chunk in s:
                started.set()
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            together[i] = text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_video_request_reaches_the_model(vlm_server: RunningServer, family: str) -> None:
    import openai

    from tests.helpers.media_samples import data_url, video

    client = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x")

    def top(clip: bytes) -> list[float]:
        r = client.chat.completions.create(
            model=family, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
                {"type": "text", "text": "What happens?"}]}])
        return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]

    assert top(video(seconds=1.0)) != top(video(seconds=2.0, width=96))


def test_anthropic_and_responses_images_get_the_same_answer(vlm_server: RunningServer) -> None:
    """The same image through the three APIs reaches the same engine pipeline."""
    import anthropic
    import openai

    url = png((30, 170, 40))
    data = url.split(",", 1)[1]
    oai = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x")
    chat = answer(oai, "qwen2_vl", url, 8)
    claude = anthropic.Anthropic(base_url=vlm_server.url, api_key="x")
    msg = claude.messages.create(model="qwen2_vl", max_tokens=8, extra_body={"temperature": 0},
                                 messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "text", "text": "What colour is this image?"}]}])
    resp = oai.responses.create(model="qwen2_vl", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                     {"type": "input_text",
                                      "text": "What colour is this image?"}]}])
    assert msg.content[0].text == chat  # type: ignore[union-attr]
    assert resp.output_text == chat


def test_tokenize_counts_an_images_tokens_like_a_chat(vlm_server: RunningServer) -> None:
    """/tokenize on a vision model expands the image through the model's processor: its
    count is the prompt_tokens a chat completion reports, and the image adds tokens."""
    import openai

    def count(messages: list[dict[str, Any]]) -> int:
        r = httpx.post(f"{vlm_server.url}/tokenize", timeout=60,
                       json={"model": "qwen2_vl", "messages": messages})
        assert r.status_code == 200, r.text
        return int(r.json()["count"])

    client = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x")
    messages = image_message(png((200, 30, 30), (96, 64)))
    usage = client.chat.completions.create(model="qwen2_vl", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=1, temperature=0).usage
    text_only = [{"role": "user", "content": "What colour is this image?"}]
    assert usage is not None and count(messages) == usage.prompt_tokens
    assert count(messages) > count(text_only) + 2  # vision markers and image pads
