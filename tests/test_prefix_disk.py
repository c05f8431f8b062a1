"""The prefix cache's disk tier (engines/text/prefix_disk.py): an entry the RAM cache evicts
is written to disk and read back when its prompt returns, across a restart too; a
corrupt file or one another model wrote is skipped with a log line, never served."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_config
from tests.helpers.server import running_server

# about 540 and 450 tokens: one entry fits the RAM cache (1 KiB per token), two do not
PROMPT_A = "Alpha " + " ".join(f"apple{k % 37}" for k in range(150))
PROMPT_B = "Beta " + " ".join(f"berry{k % 29}" for k in range(100))


def complete(http: httpx.Client, prompt: str) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def sidecars(folder: Path, at_least: int = 1) -> list[tuple[Path, dict]]:
    """The tier's entries once ``at_least`` are written (the writer is a thread)."""
    deadline = time.monotonic() + 30
    while True:
        found = sorted(folder.glob("*.json"))
        if len(found) >= at_least or time.monotonic() > deadline:
            return [(p, json.loads(p.read_text())) for p in found]
        time.sleep(0.05)


def test_evicted_entries_go_to_disk_and_come_back(tiny_model: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "home"
    cfg = tiny_config(tiny_model, home, served_model_name="tiny",
                      prefix_cache_bytes=600 * 1024, prefix_cache_disk_bytes=8 << 20,
                      enable_prefix_cache_persist=False)
    folder = home / "prefix-cache-disk" / "tiny"
    with running_server(cfg) as srv, srv.client() as http:
        first_a = complete(http, PROMPT_A)
        complete(http, PROMPT_B)  # evicts A's state from RAM
        assert sidecars(folder)
        again_a = complete(http, PROMPT_A)
        metrics = http.get("/metrics").text
    assert 'mlxd_prefix_cache_disk_reads_total{model="tiny"} 1.0' in metrics
    assert cached(first_a) == 0
    assert cached(again_a) >= first_a["usage"]["prompt_tokens"] - 2
    assert again_a["choices"][0]["text"] == first_a["choices"][0]["text"]

    # a restart reads the tier it left (the RAM cache is not saved at shutdown here)
    with running_server(cfg) as srv, srv.client() as http:
        after_restart = complete(http, PROMPT_A)
    assert cached(after_restart) >= first_a["usage"]["prompt_tokens"] - 2
    assert after_restart["choices"][0]["text"] == first_a["choices"][0]["text"]

    # corrupt A's file; mark every other entry as another model's
    n_a = first_a["usage"]["prompt_tokens"]
    entries = sidecars(folder, at_least=2)
    a_side = [p for p, info in entries if n_a <= len(info["tokens"]) <= n_a + 2]
    assert a_side
    for side, info in entries:
        if side in a_side:
            data = side.with_suffix(".safetensors")
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
        else:
            side.write_text(json.dumps({**info, "model_identity": "another-model"}))
    caplog.set_level(logging.WARNING, logger="mlxd.engines.text.prefix_disk")
    with running_server(cfg) as srv, srv.client() as http:
        corrupt_a = complete(http, PROMPT_A)
        foreign_b = complete(http, PROMPT_B)
    assert cached(corrupt_a) == 0 and cached(foreign_b) == 0
    assert corrupt_a["choices"][0]["text"] == first_a["choices"][0]["text"]
    assert "checksum mismatch" in caplog.text
    assert "written by another model" in caplog.text
