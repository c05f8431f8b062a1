"""Speculative decoding over HTTP: a tiny model served with and without it, the openai SDK
as the client. Stop strings inside an accepted draft, usage fields and /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.conftest import tiny_config
from tests.helpers.server import RunningServer, running_server

LOOP_PROMPT = "hello world, hello world, hello"  # the tiny model's greedy answer loops


@pytest.fixture(scope="module")
def servers(tiny_model: Path, test_home: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    on_cfg = tiny_config(tiny_model, test_home, served_model_name="tiny",
                         speculative="prompt-lookup", enable_prefix_cache_persist=False)
    off_cfg = tiny_config(tiny_model, test_home, served_model_name="tiny", speculative="off",
                          enable_prefix_cache_persist=False)
    with running_server(on_cfg) as on, running_server(off_cfg) as off:
        yield on, off


def _client(srv: RunningServer) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _complete(srv: RunningServer, **kw: Any) -> Any:
    return _client(srv).completions.create(model="tiny", prompt=LOOP_PROMPT, temperature=0,
                                           **kw)


def test_stop_string_inside_an_accepted_draft(servers: tuple[RunningServer, RunningServer]
                                              ) -> None:
    """The stop string ends the text where decoding without speculation ends it, and the
    drafted tokens after it are neither shown nor counted."""
    on, off = servers
    text = _complete(off, max_tokens=40).choices[0].text
    assert text.startswith("lo" * 12), text  # the tiny model's answer: a run of 'lo' tokens
    stop = "lo" * 6  # fires on the sixth token, inside a step that accepted drafts
    want = _complete(off, max_tokens=40, stop=[stop])
    got = _complete(on, max_tokens=40, stop=[stop])
    assert got.choices[0].text == want.choices[0].text == ""
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == want.usage.completion_tokens
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0


def test_usage_reports_accepted_and_rejected_drafts(servers: tuple[RunningServer, RunningServer]
                                                    ) -> None:
    on, off = servers
    got = _client(on).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LOOP_PROMPT}], temperature=0,
        max_tokens=48, n=2)
    want = _client(off).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LOOP_PROMPT}], temperature=0,
        max_tokens=48, n=2)
    assert [c.message.content for c in got.choices] == [c.message.content for c in want.choices]
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    # each choice's first token is never a draft
    assert details.accepted_prediction_tokens <= got.usage.completion_tokens - 2
    assert want.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert want.usage.completion_tokens_details.rejected_prediction_tokens == 0
    assert got.usage.completion_tokens == want.usage.completion_tokens

    metrics = on.client().get("/metrics").text
    accepted = [line for line in metrics.splitlines()
                if line.startswith('mlxd_speculative_accepted_tokens_total{model="tiny"}')]
    assert accepted and float(accepted[0].split()[-1]) >= details.accepted_prediction_tokens
    assert 'mlxd_speculative_rejected_tokens_total{model="tiny"}' in metrics
