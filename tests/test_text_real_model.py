"""The starter model served for real: answers and exact parity with mlx-lm."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.server import RunningServer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_smollm2_answers_paris_through_the_openai_sdk(smollm2_server: RunningServer) -> None:
    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    r = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"


def test_greedy_continuation_matches_mlx_lm_token_for_token(
        smollm2_server: RunningServer, smollm2: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    prompt = "The three primary colors are"
    model, tok = load(str(smollm2))
    ids = tok.encode(prompt)
    expected = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=40, sampler=make_sampler(0.0)):
        expected.append(int(token))
    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
                                  logprobs=0)
    got_text = r.choices[0].text
    assert got_text == tok.decode(expected)
    assert r.choices[0].logprobs.tokens == [tok.decode([i]) for i in expected]


def test_starter_entry_answers_paris_with_its_serving_defaults(smollm2: Path) -> None:
    """A client that sends no sampling fields gets the starter entry's defaults."""
    from mlxd.config import ServerConfig
    from mlxd.models.catalog import Catalog, registration_for
    from mlxd.models.manager import ManagerPolicy
    from mlxd.models.starter import STARTER_CHAT
    from tests.helpers.server import running_server

    assert STARTER_CHAT.defaults.temperature == 0.0
    entry = STARTER_CHAT.model_copy(update={"source": str(smollm2)})
    cfg = ServerConfig(no_starter=True, home=smollm2.parent)
    catalog = Catalog([registration_for(entry, cfg, 8 * 2**30)], ManagerPolicy(8 * 2**30),
                      aliases={"default": entry.name})
    with running_server(cfg, catalog=catalog) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
        for _ in range(3):
            r = client.chat.completions.create(
                model="default", max_tokens=20,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert "Paris" in (r.choices[0].message.content or "")
