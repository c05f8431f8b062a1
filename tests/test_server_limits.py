"""API keys, admin keys and the body-size limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import tiny_config
from tests.helpers.server import RunningServer, running_server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    cfg = tiny_config(tiny_model, test_home, served_model_name="tiny", api_key="sekret",
                      admin_api_key="admin-sekret", max_body_bytes=4096)
    with running_server(cfg) as srv:
        yield srv


def test_health_needs_no_key(keyed_server: RunningServer) -> None:
    assert httpx.get(keyed_server.url + "/health").status_code == 200


def test_requests_without_key_are_401_in_openai_shape(keyed_server: RunningServer) -> None:
    r = httpx.post(keyed_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": HI})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_anthropic_paths_get_anthropic_error_shape(keyed_server: RunningServer) -> None:
    r = httpx.post(keyed_server.url + "/v1/messages", json={})
    assert r.status_code == 401
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_bearer_and_x_api_key_both_work(keyed_server: RunningServer) -> None:
    for headers in ({"Authorization": "Bearer sekret"}, {"x-api-key": "sekret"}):
        assert httpx.get(keyed_server.url + "/v1/models", headers=headers).status_code == 200


def test_sdk_with_key_works_and_wrong_key_raises(keyed_server: RunningServer) -> None:
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sekret", max_retries=0)
    assert good.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_admin_routes_need_the_admin_key(keyed_server: RunningServer) -> None:
    url = keyed_server.url + "/v1/models/unload"
    r = httpx.post(url, json={"model": "tiny"}, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 403
    r = httpx.post(url, json={"model": "tiny"}, headers={"Authorization": "Bearer admin-sekret"})
    assert r.status_code == 200


def test_oversized_body_is_413_before_parsing(keyed_server: RunningServer) -> None:
    big = [{"role": "user", "content": "x" * 10_000}]
    r = httpx.post(keyed_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": big},
                   headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 413
    assert "exceeds the limit" in r.json()["error"]["message"]


def test_metrics_expose_models_memory_and_queues(tiny_server: RunningServer) -> None:
    with tiny_server.client() as http:
        http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
        text = http.get("/metrics").text
    assert "mlxd_memory_budget_bytes" in text
    assert 'mlxd_model_state{kind="text",model="tiny",state="loaded"} 1.0' in text
    assert 'mlxd_requests_running{model="tiny"} 0.0' in text
    assert 'mlxd_model_loads_total{model="tiny"}' in text
