"""An answer that must come from the image (issue 11): tiny VLMs of three real families
(qwen2_vl, llava, gemma3), trained at test time to name an image's colour, served over HTTP.
Eight requests at once, images that differ only in colour, batched together: each gets its
own image's colour. This catches mixed-up images in a batch, a cache entry shared across
images, and a broken patch."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlxd.models.spec import ModelEntry
from tests.helpers.retrieval import registry_config
from tests.helpers.server import RunningServer, running_server
from tests.helpers.tiny_vlm_colours import COLOURS, NAMES, QUESTION

pytest.importorskip("mlx_vlm")
# Training three models is the module fixture's setup: seconds on an idle 2-core runner,
# minutes on a loaded one.
pytestmark = pytest.mark.timeout(1200)

TRAINED = ["qwen2_vl", "llava", "gemma3"]


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (84, 84)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def colour_server(session_dir: Path, test_home: Path) -> Iterator[RunningServer]:
    from tests.helpers.tiny_vlm import build_tiny_vlm
    from tests.helpers.tiny_vlm_colours import train_colours

    root = session_dir / "tiny-vlm"
    entries = []
    for family in TRAINED:
        src = build_tiny_vlm(family, root / family, root / "tokenizers")
        trained = train_colours(src, session_dir / "colour-vlm" / family)
        entries.append(ModelEntry(name=family, source=str(trained)))
    cfg = registry_config(session_dir / "colour-models.yaml", entries, test_home,
                          max_num_seqs=8)
    with running_server(cfg) as srv:
        yield srv


def ask(client: object, model: str, url: str) -> str:
    r = client.chat.completions.create(  # type: ignore[attr-defined]
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": QUESTION}]}])
    return str(r.choices[0].message.content).strip()


@pytest.mark.parametrize("family", TRAINED)
def test_each_request_in_a_batch_gets_its_own_images_colour(colour_server: RunningServer,
                                                            family: str) -> None:
    import openai

    client = openai.OpenAI(base_url=colour_server.url + "/v1", api_key="x", max_retries=0)
    urls = [png(COLOURS[n]) for n in NAMES]  # same size: they differ only in colour
    with ThreadPoolExecutor(len(urls)) as pool:
        answers = list(pool.map(lambda u: ask(client, family, u), urls))
    assert answers == NAMES


def test_turn_two_on_the_same_image_reuses_its_features(colour_server: RunningServer) -> None:
    import openai

    client = openai.OpenAI(base_url=colour_server.url + "/v1", api_key="x", max_retries=0)
    url = png(COLOURS["orange"], (112, 84))
    engine = colour_server.ctx.manager.get("qwen2_vl").engine
    hits = engine.features.hits
    assert ask(client, "qwen2_vl", url) == "orange"
    assert engine.features.hits == hits  # first time: encoded
    assert ask(client, "qwen2_vl", url) == "orange"
    assert engine.features.hits == hits + 1  # second time: from the cache
    card = {m["id"]: m for m in colour_server.client().get("/v1/models").json()["data"]}
    assert card["qwen2_vl"]["feature_cache_hits"] == hits + 1
    assert engine.memory_bytes() > engine.features.nbytes > 0  # counted in its memory
