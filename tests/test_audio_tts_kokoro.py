"""mlx-audio's Kokoro with random weights of its real architecture (tests/helpers/tiny_tts.py).

The TTSEngine loads it through mlx-audio's loader; the text goes through
espeak-ng (never misaki, never the network). Checked: sample rate and shape,
speed, every response format decoding back with PyAV to the same duration,
voice refusals, and the CPU convolution patch (identical outputs to MLX's own
convolutions on the model's real layers, applied only while loaded, undone to
the very upstream object).
"""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest

from mlxd.config import ServerConfig
from mlxd.engines.base import SpeechRequest
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.media.audio_encode import PCM_RATE, SPEECH_FORMATS, encode_speech, speech_encoder
from mlxd.runtime.worker import ModelWorker
from tests.helpers.tiny_tts import SAMPLE_RATE, build_tiny_kokoro

pytest.importorskip("mlx_audio")
pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                reason="the espeak-ng program is not installed")
mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def kokoro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_kokoro(tmp_path_factory.mktemp("tiny-kokoro"))


def test_the_patch_lives_only_while_a_kokoro_model_is_loaded(kokoro_dir: Path) -> None:
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    from mlxd.engines.audio.patches import kokoro_conv, registry
    from mlxd.engines.audio.tts_mlx_audio import MlxAudioBackend

    # First in this module: no engine of it holds the patch yet.
    assert registry().active() == []
    upstream = ConvWeighted.__call__
    first = MlxAudioBackend.load("a", kokoro_dir)
    second = MlxAudioBackend.load("b", kokoro_dir)
    assert ConvWeighted.__call__ is not upstream
    first.close()
    assert ConvWeighted.__call__ is not upstream  # the second model still holds it
    second.close()
    assert ConvWeighted.__call__ is upstream and registry().active() == []
    assert kokoro_conv.self_check()


@pytest.fixture(scope="module")
def engine(kokoro_dir: Path) -> Iterator[object]:
    from mlxd.engines.audio.tts import TTSEngine

    worker = ModelWorker("tiny-kokoro")
    worker.start()
    eng = TTSEngine("tiny-kokoro", kokoro_dir, worker, ServerConfig())
    worker.submit(eng.load).result(timeout=300)
    try:
        yield eng
    finally:
        worker.submit(eng.close).result(timeout=60)
        worker.stop()


def _speak(engine: object, text: str, voice: str, speed: float = 1.0) -> list[object]:
    async def collect() -> list[object]:
        return [c async for c in engine.synthesize(  # type: ignore[attr-defined]
            SpeechRequest(text=text, voice=voice, speed=speed))]

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def hi(engine: object) -> bytes:
    chunks = _speak(engine, "Hi.", "af_test")
    assert len(chunks) == 1 and chunks[0].sample_rate == SAMPLE_RATE  # type: ignore[attr-defined]
    return chunks[0].pcm  # type: ignore[attr-defined,no-any-return]


def test_kokoro_speaks_at_its_rate_with_its_voices(engine: object, hi: bytes) -> None:
    samples = np.frombuffer(hi, "<i2")
    # 4 phonemes + 2 boundary tokens, 2 frames each (tiny max_dur), 600 samples a frame
    assert samples.shape == (7200,)
    assert samples.std() > 10  # real numbers, not the silence NaNs would become
    desc = engine.describe()  # type: ignore[attr-defined]
    assert desc["sample_rate"] == SAMPLE_RATE and desc["voices"] == ["af_test", "bm_test"]
    assert desc["family"] == "kokoro" and desc["cpu_conv_patch"] is True


def test_speed_two_halves_the_duration(engine: object) -> None:
    chunks = _speak(engine, "Hi.", "bm_test", speed=2.0)  # British voice: en-gb phonemes
    assert len(chunks[0].pcm) // 2 == 3600  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_every_format_decodes_back_to_the_same_duration(hi: bytes, fmt: str) -> None:
    seconds = len(hi) / 2 / SAMPLE_RATE
    streamed = speech_encoder(fmt, SAMPLE_RATE)
    halves = (hi[: len(hi) // 2], hi[len(hi) // 2:])
    as_stream = b"".join(streamed.encode(h) for h in halves) + streamed.finish()
    for data in (encode_speech(hi, SAMPLE_RATE, fmt), as_stream):
        if fmt == "pcm":
            got, rate = len(data) / 2, PCM_RATE
        else:
            with av.open(io.BytesIO(data)) as c:
                rate = c.streams.audio[0].sample_rate
                got = sum(f.samples for f in c.decode(audio=0))
        # wav, flac and pcm are exact; lossy codecs add priming and pad to whole frames
        # (mp3 1152 samples, aac 1024, opus 20 ms): at most two frames, under 0.1 s.
        tolerance = 1 / rate if fmt in ("wav", "flac", "pcm") else 0.1
        assert abs(got / rate - seconds) <= tolerance, (fmt, got / rate, seconds)


def test_unknown_voice_and_bad_speed_are_refused(engine: object) -> None:
    with pytest.raises(InvalidRequest, match="af_test, bm_test"):
        _speak(engine, "Hi.", "alloy")
    with pytest.raises(InvalidRequest, match="speed"):
        _speak(engine, "Hi.", "af_test", speed=float("nan"))


def test_a_long_sentence_is_cut_to_the_context_and_the_voice_row_stays_in_range(
        engine: object) -> None:
    backend = engine.backend  # type: ignore[attr-defined]
    phonemes = backend.phonemes("supercalifragilistic " * 60, "af_test")
    assert len(phonemes) == 510 and set(phonemes) <= set(backend.vocab)


def test_other_mlx_audio_families_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    from mlxd.engines.audio.tts_mlx_audio import MlxAudioBackend

    (tmp_path / "config.json").write_text('{"model_type": "bark"}')
    with pytest.raises(ModelLoadError, match="kokoro"):
        MlxAudioBackend.load("bark", tmp_path)


# -- the CPU convolution patch -------------------------------------------------------------

def test_patched_convolutions_equal_mlx_on_the_models_own_layers(engine: object) -> None:
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    from mlxd.engines.audio.patches import registry

    assert "kokoro-cpu-conv-matmul" in registry().active()
    patched = ConvWeighted.__call__
    upstream = next(o for owner, attr, o in registry()._applied[
        "kokoro-cpu-conv-matmul"].originals if attr == "__call__")
    generator = engine.backend.model.decoder.generator  # type: ignore[attr-defined]
    up = generator.ups[0]  # transposed: 512 -> 256 channels, kernel 20, stride 10
    x = mx.random.normal((1, 12, 512), key=mx.random.key(3))
    want = upstream(up, x, mx.conv_transpose1d)
    got = patched(up, x, mx.conv_transpose1d)
    assert want.shape == got.shape and mx.allclose(want, got, atol=1e-3, rtol=1e-4).item()
    conv = generator.resblocks[0].convs1[1]  # dilation 3
    assert conv.dilation == 3
    y = mx.random.normal((1, 40, conv.weight_v.shape[-1]), key=mx.random.key(4))
    want, got = upstream(conv, y, mx.conv1d), patched(conv, y, mx.conv1d)
    assert want.shape == got.shape and mx.allclose(want, got, atol=1e-3, rtol=1e-4).item()
