"""mlx-audio's speech-recognition families through mlx-audio's loader: a random-weight
Moonshine of the real architecture, served window by window over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxd.models.spec import ModelEntry
from tests.helpers.audio import build_tiny_moonshine, wav
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("mlx_audio", reason="mlx-audio is in the `audio` extra")
pytest.importorskip("av", reason="PyAV is in the `audio` extra")

MODEL = "moonshine-tiny"
URL = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def moonshine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moonshine(tmp_path_factory.mktemp("moonshine") / "model")


@pytest.fixture(scope="module")
def server(moonshine: Path, tmp_path_factory: pytest.TempPathFactory,
           test_home: Path) -> Iterator[RunningServer]:
    cfg = registry_config(tmp_path_factory.mktemp("families") / "models.yaml",
                          [ModelEntry(name=MODEL, source=str(moonshine))], test_home)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def recording() -> np.ndarray:
    """65 s of a quiet chirp at 16 kHz: three windows (30 + 30 + 5 s)."""
    t = np.arange(65 * 16_000) / 16_000
    return (0.1 * np.sin(2 * np.pi * (200 + 20 * t) * t)).astype(np.float32)


def _post(srv: RunningServer, audio: np.ndarray, **fields: str) -> Any:
    with srv.client() as http:
        return http.post(URL, data={"model": MODEL, **fields},
                         files={"file": ("a.wav", wav(audio), "audio/wav")})


def test_long_audio_is_transcribed_window_by_window_like_the_family_itself(
        server: RunningServer, moonshine: Path, recording: np.ndarray) -> None:
    from mlx_audio.stt.utils import load_model

    r = _post(server, recording, response_format="verbose_json")
    assert r.status_code == 200, r.text
    body = r.json()
    model = load_model(moonshine)  # the family's own generate, window by window
    sent = np.frombuffer(wav(recording)[44:], "<i2").astype(np.float32) / 32768
    expected = [model.generate(sent[i:i + 30 * 16_000]).text.strip()
                for i in range(0, len(sent), 30 * 16_000)]
    assert body["text"] == " ".join(t for t in expected if t)
    assert [s["start"] for s in body["segments"]] == [0.0, 30.0, 60.0]
    assert all(s["start"] < s["end"] <= body["duration"] for s in body["segments"])
    assert body["duration"] == 65.0


@pytest.mark.parametrize(("path", "fields", "param"), [
    (URL, {"response_format": "verbose_json", "timestamp_granularities[]": "word"},
     "timestamp_granularities"),
    ("/v1/audio/translations", {}, "model"),
])
def test_what_only_whisper_gives_is_400(server: RunningServer, recording: np.ndarray,
                                        path: str, fields: dict[str, str], param: str) -> None:
    with server.client() as http:
        r = http.post(path, data={"model": MODEL, **fields},
                      files={"file": ("a.wav", wav(recording[:16_000]), "audio/wav")})
    assert_openai_error(r, 400, param=param)


def test_stream_sends_one_delta_per_window_as_it_is_decoded(server: RunningServer,
                                                            recording: np.ndarray) -> None:
    whole = _post(server, recording).json()["text"]
    r = _post(server, recording, stream="true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["transcript.text.delta"] * 3 + ["transcript.text.done"]
    assert "".join(e["delta"] for e in events[:-1]) == events[-1]["text"] == whole
