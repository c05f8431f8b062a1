"""``mlxd bench`` against a real mlxd server on 127.0.0.1 (tiny random model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxd.cli import main
from tests.conftest import tiny_config
from tests.helpers.server import RunningServer, running_server

SMALL = ["--prompt-tokens", "48", "--max-tokens", "8", "--no-progress", "--timeout", "30",
         "--max-duration", "30"]


@pytest.fixture(scope="module")
def bench_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    with running_server(tiny_config(tiny_model, test_home, served_model_name="tiny")) as srv:
        yield srv


def bench(srv: RunningServer, *args: str) -> int:
    return main(["bench", "--url", srv.url, "--model", "tiny", *SMALL, *args])


def test_json_report_has_every_level_and_metric(bench_server: RunningServer, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert bench(bench_server, "--concurrency", "1,2", "--requests", "2", "--json",
                 str(out)) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "mlxd.bench/1"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["ok"] == lv["requests_sent"] == 2
        assert lv["errors"] == {}
        assert lv["output_tokens"] > 0 and lv["aggregate_tok_s"] > 0
        assert lv["ttft_s"]["p50"] > 0 and lv["ttft_s"]["p95"] >= lv["ttft_s"]["p50"]
        assert lv["itl_s"]["p99"] >= lv["itl_s"]["p50"] > 0
        assert lv["per_stream_decode_tok_s"]["p50"] > 0
        assert lv["prompt_tokens_mean"] > 0
        assert lv["cached_tokens"]["reported"] == 2
    table = capsys.readouterr().out
    assert "| concurrency | ok/sent | output tok/s |" in table
    assert "| 2 | 2/2 |" in table


def test_completions_api_is_measured_too(bench_server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench(bench_server, "--api", "completions", "--concurrency", "2", "--requests", "2",
                 "--json", str(out)) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["ok"] == 2 and level["output_tokens"] > 0


def test_multi_turn_reports_cached_tokens_on_later_turns(bench_server: RunningServer,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench(bench_server, "--concurrency", "1", "--multi-turn", "3", "--requests", "3",
                 "--warmup", "0", "--json", str(out)) == 0
    turns = json.loads(out.read_text())["levels"][0]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[1]["prompt_tokens_mean"] > turns[0]["prompt_tokens_mean"]
    for later in turns[1:]:
        assert later["cached_tokens_mean"] > 0


def test_wrong_model_name_is_counted_as_errors(bench_server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--url", bench_server.url, "--model", "no-such-model", *SMALL,
               "--concurrency", "2", "--requests", "3", "--warmup", "0", "--json", str(out)])
    assert rc == 1
    level = json.loads(out.read_text())["levels"][0]
    assert level["ok"] == 0
    assert level["errors"] == {"404": 3}


def test_non_loopback_target_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--url", "http://192.0.2.10:8000", "--requests", "1", "--no-progress"])
    assert rc == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_any_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # a lean install: no bench extra
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    # Port 9 (discard) has no server: reaching the load generator would be an error count, not 2.
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--requests", "1", "--no-progress",
               "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "pip install 'mlxd[bench]'" in capsys.readouterr().err


def test_loopback_names_are_accepted() -> None:
    from mlxd.benchmark.loadgen import is_loopback_url

    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80",
                "http://127.3.2.1"):
        assert is_loopback_url(url), url
    for url in ("http://10.0.0.1", "http://example.com", "http://0.0.0.0:8000"):
        assert not is_loopback_url(url), url


def test_prompt_length_follows_prompt_tokens() -> None:
    from mlxd.benchmark.prompts import PromptSpec

    spec = PromptSpec(prompt_tokens=200, shared_prefix_tokens=100, seed=3)
    a, b = spec.text(0), spec.text(1)
    prefix = spec.shared_prefix()
    assert a.startswith(prefix) and b.startswith(prefix) and a != b
    assert 150 <= len(a.split()) <= 200


def test_plot_is_written_as_png(bench_server: RunningServer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert bench(bench_server, "--concurrency", "1,2", "--requests", "2", "--warmup", "0",
                 "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_generator_never_imports_mlx() -> None:
    import subprocess
    import sys

    code = ("import sys, mlxd.cli.bench, mlxd.benchmark.loadgen, mlxd.benchmark.report; "
            "sys.exit(1 if any(m == 'mlx' or m.startswith(('mlx.', 'mlx_')) for m in sys.modules)"
            " else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
