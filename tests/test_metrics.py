"""Per-request metrics, request ids and the request log line, against a real tiny server."""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.config import ServerConfig
from mlxd.server.logs import JsonFormatter, configure_logging
from tests.helpers.server import RunningServer, running_server

CHAT = "/v1/chat/completions"


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics keyed by (name, sorted labels)."""
    resp = client.get("/metrics")
    assert resp.status_code == 200
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(client: httpx.Client, text: str, *, stream: bool = False,
         headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return client.post(CHAT, json=body, headers=headers or {})


def stream_usage(resp: httpx.Response) -> dict[str, Any]:
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    return next(c["usage"] for c in chunks if c.get("usage"))


@pytest.fixture(scope="module")
def traffic(tiny_server: RunningServer) -> dict[str, Any]:
    """A few real requests (plain, repeated prompt, stream, errors) and the scrapes around
    them; the log records they produced."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("mlxd.request")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with tiny_server.client() as client:
            chat(client, "warm up").raise_for_status()  # the model is loaded before `before`
            before = scrape(client)
            prompt = f"tell me about metrics {uuid.uuid4().hex}"
            first = chat(client, prompt, headers={"X-Request-Id": "client-id-1"})
            again = chat(client, prompt)
            streamed = chat(client, "a streamed answer", stream=True)
            bad_id = chat(client, "hi", headers={"X-Request-Id": "has space" + "x" * 200})
            unknown = client.post(CHAT, json={"model": "nope", "messages": [
                {"role": "user", "content": "hi"}]})
            not_json = client.post(CHAT, content=b"{", headers={"content-type":
                                                                "application/json"})
            after = scrape(client)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return {"before": before, "after": after, "first": first, "again": again,
            "streamed": streamed, "bad_id": bad_id, "unknown": unknown, "not_json": not_json,
            "records": records}


def delta(traffic: dict[str, Any], name: str, **labels: str) -> float:
    return value(traffic["after"], name, **labels) - value(traffic["before"], name, **labels)


def test_requests_are_counted_by_route_model_and_status(traffic: dict[str, Any]) -> None:
    for key in ("first", "again", "streamed", "bad_id"):
        assert traffic[key].status_code == 200, traffic[key].text
    assert traffic["unknown"].status_code == 404
    assert traffic["not_json"].status_code == 400
    labels = {"route": CHAT, "method": "POST"}
    assert delta(traffic, "mlxd_requests_total", **labels, model="tiny", status="200") == 4
    # an unknown name never becomes a label (bounded cardinality): the model is empty
    assert delta(traffic, "mlxd_requests_total", **labels, model="", status="404") == 1
    assert delta(traffic, "mlxd_requests_total", **labels, model="", status="400") == 1
    assert delta(traffic, "mlxd_request_duration_seconds_count", route=CHAT, model="tiny") == 4


def test_tokens_and_cached_tokens_match_the_usage_clients_got(traffic: dict[str, Any]) -> None:
    usages = [traffic[k].json()["usage"] for k in ("first", "again", "bad_id")]
    usages.append(stream_usage(traffic["streamed"]))
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert traffic["again"].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert delta(traffic, "mlxd_prompt_tokens_total", model="tiny") == \
        sum(u["prompt_tokens"] for u in usages)
    assert delta(traffic, "mlxd_completion_tokens_total", model="tiny") == \
        sum(u["completion_tokens"] for u in usages)
    assert delta(traffic, "mlxd_cached_prompt_tokens_total", model="tiny") == cached > 0


def test_latency_histograms_have_one_observation_per_generation(traffic: dict[str, Any]) -> None:
    for name in ("mlxd_time_to_first_token_seconds", "mlxd_queue_wait_seconds",
                 "mlxd_prefill_seconds", "mlxd_inter_token_latency_seconds"):
        assert delta(traffic, f"{name}_count", model="tiny") == 4, name
        assert delta(traffic, f"{name}_sum", model="tiny") >= 0, name
    after = traffic["after"]
    # time to first token includes queueing and prefill, so it is at least the queue wait
    assert value(after, "mlxd_time_to_first_token_seconds_sum", model="tiny") >= \
        value(after, "mlxd_queue_wait_seconds_sum", model="tiny")


def test_scheduler_cache_and_model_series(traffic: dict[str, Any]) -> None:
    after = traffic["after"]
    steps = delta(traffic, "mlxd_scheduler_steps_total", model="tiny")
    assert steps > 0
    assert delta(traffic, "mlxd_batch_size_count", model="tiny") == steps
    assert delta(traffic, "mlxd_batch_size_sum", model="tiny") >= steps  # >= 1 per step
    assert value(after, "mlxd_batch_size_bucket", model="tiny", le="+Inf") == \
        value(after, "mlxd_batch_size_count", model="tiny")
    assert delta(traffic, "mlxd_prefix_cache_lookups_total", model="tiny") == 4
    assert delta(traffic, "mlxd_prefix_cache_hits_total", model="tiny") >= 1
    assert value(after, "mlxd_model_load_seconds_count", model="tiny") == 1
    assert value(after, "mlxd_model_load_seconds_sum", model="tiny") > 0
    assert value(after, "mlxd_model_memory_bytes", model="tiny") > 0
    assert ("mlxd_evictions_total", ()) in after
    assert ("mlxd_requests_running", (("model", "tiny"),)) in after


def test_request_id_is_echoed_when_valid_and_generated_otherwise(
        traffic: dict[str, Any]) -> None:
    assert traffic["first"].headers["x-request-id"] == "client-id-1"
    generated = {traffic[k].headers["x-request-id"]
                 for k in ("again", "streamed", "bad_id", "unknown", "not_json")}
    assert len(generated) == 5  # every response has one, each its own
    for rid in generated:
        assert len(rid) == 32 and all(c in "0123456789abcdef" for c in rid), rid


def test_one_json_log_line_per_request(traffic: dict[str, Any]) -> None:
    lines = [json.loads(JsonFormatter().format(r)) for r in traffic["records"]]
    by_id = {line["request_id"]: line for line in lines}
    line = by_id["client-id-1"]
    usage = traffic["first"].json()["usage"]
    assert line["route"] == CHAT and line["method"] == "POST" and line["status"] == 200
    assert line["model"] == "tiny" and line["logger"] == "mlxd.request"
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert 0 < line["ttft_s"] <= line["duration_s"]
    streamed = by_id[traffic["streamed"].headers["x-request-id"]]
    assert streamed["completion_tokens"] == stream_usage(traffic["streamed"])["completion_tokens"]
    refused = by_id[traffic["unknown"].headers["x-request-id"]]
    assert refused["status"] == 404 and refused["model"] is None and refused["ttft_s"] is None


def test_json_log_format_configures_every_line_as_json() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        kwargs = configure_logging("info", "json")
        assert kwargs == {"access_log": False, "log_config": None}
        assert isinstance(root.handlers[-1].formatter, JsonFormatter)
        assert configure_logging("info", "text") == {"access_log": False}
        assert not isinstance(root.handlers[-1].formatter, JsonFormatter)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)


def test_every_exported_metric_is_documented(traffic: dict[str, Any]) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    names = {name for name, _ in traffic["after"] if not name.endswith("_created")}
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}
    missing = sorted(f for f in families if f"`{f}`" not in doc)
    assert not missing, f"add to docs/metrics.md: {missing}"


def test_refusals_before_routing_are_counted_under_their_route(tmp_path: Path) -> None:
    """A 401 from the auth middleware (before routing) still has a request id and is
    counted under the route it was refused for; an unknown path is `unmatched`."""
    config = ServerConfig(home=tmp_path, no_starter=True, api_key="k",
                          allow_no_models=True)
    with running_server(config) as srv, srv.client() as client:
        refused = client.post(CHAT, json={"model": "m", "messages": []})
        assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 32
        assert client.get("/no/such/path").status_code == 401
        samples = scrape(httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer k"}))
    assert value(samples, "mlxd_requests_total", route=CHAT, method="POST", model="",
                 status="401") == 1
    assert value(samples, "mlxd_requests_total", route="unmatched", method="GET", model="",
                 status="401") == 1


def test_embedding_and_rerank_input_tokens_are_counted(mixed_server: RunningServer) -> None:
    with mixed_server.client() as client:
        before = scrape(client)
        emb = client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                                  "input": ["a cat", "a dog on a mat"]})
        rr = client.post("/v1/rerank", json={"model": "rerank", "query": "pets",
                                             "documents": ["a cat", "a car"]})
        after = scrape(client)
    assert emb.status_code == 200 and rr.status_code == 200
    for model, resp in (("all-minilm-l6-v2", emb), ("rerank", rr)):
        used = resp.json()["usage"]["prompt_tokens"]
        assert used > 0
        grew = (value(after, "mlxd_prompt_tokens_total", model=model)
                - value(before, "mlxd_prompt_tokens_total", model=model))
        assert grew == used, model
