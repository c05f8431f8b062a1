"""Audio uploads refused before any work: every limit and every bad upload is a clear 4xx in
OpenAI's error shape, and the Whisper model stays unloaded after each refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlxd.errors import InvalidRequest, PayloadTooLarge
from mlxd.media.audio_decode import decode_audio
from mlxd.media.audio_limits import AudioLimits
from mlxd.models.starter import STARTER_STT
from mlxd.server.multipart import read_multipart
from tests.helpers.audio import SHORT, decode, espeak_wav, mp3, resample, wav
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("av", reason="PyAV is in the `audio` extra")

MODEL = STARTER_STT.name
URL = "/v1/audio/transcriptions"
LIMIT_BYTES = 200_000
LIMIT_SECONDS = 4.0


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return decode(espeak_wav(SHORT))  # ~1.5 s at 16 kHz


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, test_home: Path) -> Iterator[RunningServer]:
    cfg = registry_config(tmp_path_factory.mktemp("stt-limits") / "models.yaml",
                          [STARTER_STT.model_copy()], test_home,
                          max_audio_upload_bytes=LIMIT_BYTES, max_audio_seconds=LIMIT_SECONDS,
                          max_audio_channels=2, max_audio_sample_rate=48_000)
    with running_server(cfg) as srv:
        yield srv


def _post(srv: RunningServer, data: bytes | None, **fields: str) -> httpx.Response:
    # No data: a multipart form with only text fields.
    files = {"file": ("audio.wav", data, "audio/wav")} if data is not None else \
        {"prompt": (None, "hello")}
    with srv.client() as http:
        return http.post(URL, data={"model": MODEL, **fields}, files=files)


def _state(srv: RunningServer) -> str:
    with srv.client() as http:
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    return str(cards[MODEL]["state"])


@pytest.fixture
def stays_unloaded(server: RunningServer) -> Iterator[RunningServer]:
    """The refusal under test must leave the Whisper model unloaded (checked after)."""
    assert _state(server) == "unloaded"
    yield server
    assert _state(server) == "unloaded"


def test_upload_over_the_byte_limit_is_413(stays_unloaded: RunningServer) -> None:
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 160_000).astype(np.float32)
    r = _post(stays_unloaded, wav(noise))  # 320 KB of 16-bit PCM
    assert_openai_error(r, 413, "--max-audio-upload-bytes", param="file")


def test_audio_longer_than_the_limit_is_400(stays_unloaded: RunningServer,
                                            speech: np.ndarray) -> None:
    long = np.tile(speech, 4)  # ~6 s, as 16 kHz mp3 well under the byte limit
    r = _post(stays_unloaded, mp3(long))
    assert_openai_error(r, 400, "--max-audio-seconds", param="file")


def test_too_many_channels_is_400(stays_unloaded: RunningServer, speech: np.ndarray) -> None:
    r = _post(stays_unloaded, wav(speech[:8000], channels=3))
    assert_openai_error(r, 400, "3 channels", param="file")


def test_sample_rate_over_the_limit_is_400(stays_unloaded: RunningServer,
                                           speech: np.ndarray) -> None:
    r = _post(stays_unloaded, wav(resample(speech[:4000], 16_000, 96_000), rate=96_000))
    assert_openai_error(r, 400, "96000 Hz", param="file")


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"this is not audio at all" * 50, "not audio"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not audio"),  # a WAV header cut short
])
def test_bad_files_are_400(stays_unloaded: RunningServer, data: bytes, message: str) -> None:
    assert_openai_error(_post(stays_unloaded, data), 400, message, param="file")


def test_missing_file_is_400(stays_unloaded: RunningServer) -> None:
    assert_openai_error(_post(stays_unloaded, None), 400, "'file'", param="file")


def test_json_body_is_400(stays_unloaded: RunningServer) -> None:
    with stays_unloaded.client() as http:
        r = http.post(URL, json={"model": MODEL, "file": "x"})
    assert_openai_error(r, 400, "multipart/form-data")


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "xml"}, "response_format"),
    ({"temperature": "1.5"}, "temperature"),
    ({"temperature": "nan"}, "temperature"),
    ({"language": "english"}, "language"),
    ({"timestamp_granularities[]": "word"}, None),  # needs verbose_json
    ({"timestamp_granularities[]": "phoneme", "response_format": "verbose_json"},
     "timestamp_granularities.0"),
    ({"stream": "true", "response_format": "srt"}, None),
    ({"prompt": "x" * 5000}, "prompt"),
    ({"model": ""}, "model"),
])
def test_bad_fields_are_400(stays_unloaded: RunningServer, speech: np.ndarray,
                            fields: dict[str, str], param: str | None) -> None:
    assert_openai_error(_post(stays_unloaded, wav(speech[:1600]), **fields), 400, param=param)


def test_unknown_model_is_404(stays_unloaded: RunningServer) -> None:
    with stays_unloaded.client() as http:
        r = http.post(URL, data={"model": "nope"}, files={"file": ("a.wav", b"x")})
    assert r.status_code == 404, r.text


# -- the multipart reader refuses while the body streams in ---------------------------------

async def _endless_upload(sent: list[int], chunk: int = 64 * 1024) -> AsyncIterator[bytes]:
    yield (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
           b"Content-Type: audio/wav\r\n\r\n")
    while True:  # a client that would send forever
        sent[0] += chunk
        yield b"\0" * chunk


def test_upload_limit_is_enforced_while_the_body_streams() -> None:
    sent = [0]
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_multipart("multipart/form-data; boundary=b", None,
                                   _endless_upload(sent), file_field="file",
                                   max_file_bytes=1_000_000))
    assert 1_000_000 <= sent[0] <= 1_000_000 + 64 * 1024  # one chunk past the limit, no more


def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    sent = [0]
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_multipart("multipart/form-data; boundary=b", str(2**31),
                                   _endless_upload(sent), file_field="file",
                                   max_file_bytes=1_000_000))
    assert sent[0] == 0


def test_body_without_closing_boundary_is_400() -> None:
    async def cut() -> AsyncIterator[bytes]:
        yield b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper"

    with pytest.raises(InvalidRequest, match="closing boundary"):
        asyncio.run(read_multipart("multipart/form-data; boundary=b", None, cut(),
                                   file_field="file", max_file_bytes=100))


# -- decoding ------------------------------------------------------------------------------

def test_truncated_mp3_decodes_up_to_the_cut(speech: np.ndarray) -> None:
    data = mp3(np.tile(speech, 2))
    whole = decode_audio(data, AudioLimits()).seconds
    half = decode_audio(data[:len(data) // 2], AudioLimits()).seconds
    assert 0.3 * whole < half < 0.7 * whole


def test_decoded_audio_is_16khz_mono_float32(speech: np.ndarray) -> None:
    audio = decode_audio(wav(resample(speech, 16_000, 44_100), rate=44_100, channels=2),
                         AudioLimits())
    assert (audio.sample_rate, audio.source_rate, audio.source_channels) == (16_000, 44_100, 2)
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert abs(audio.seconds - len(speech) / 16_000) < 0.01


@pytest.fixture(scope="module")
def small_body_server(tmp_path_factory: pytest.TempPathFactory,
                      test_home: Path) -> Iterator[RunningServer]:
    """--max-body-bytes below --max-audio-upload-bytes: uploads follow their own limit."""
    cfg = registry_config(tmp_path_factory.mktemp("stt-body") / "models.yaml",
                          [STARTER_STT.model_copy()], test_home,
                          max_body_bytes=LIMIT_BYTES // 2, max_audio_upload_bytes=LIMIT_BYTES)
    with running_server(cfg) as srv:
        yield srv


def test_uploads_follow_the_audio_limit_not_the_body_limit(
        small_body_server: RunningServer) -> None:
    garbage = bytes(range(256)) * (LIMIT_BYTES * 3 // 4 // 256)  # over the body limit
    # read and refused as a bad file (not a 413 for the body): the upload limit applies
    assert_openai_error(_post(small_body_server, garbage), 400, param="file")
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 160_000).astype(np.float32)
    assert_openai_error(_post(small_body_server, wav(noise)), 413, "--max-audio-upload-bytes",
                        param="file")
    with small_body_server.client() as http:  # every other route keeps --max-body-bytes
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "x" * LIMIT_BYTES}]})
    assert_openai_error(r, 413, "exceeds the limit")
    assert _state(small_body_server) == "unloaded"
