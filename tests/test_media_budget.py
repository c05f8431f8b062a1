"""Decoded media inside the memory budget (issue 31 items 2 and 3).

A request's images are capped in decoded pixels as a whole (``--max-media-pixels``),
decoded one at a time and scaled to what the model's processor uses before the
next is read, and what preparing them holds is counted in the ModelManager's
budget, as are an upload's decoded audio samples: concurrent requests whose
decoded media do not fit beside the loaded models wait for each other instead of
adding up. Peak memory is measured from /proc/self/status (the server runs in
this process); the images are large in pixels but a few KB each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import io
import threading
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.errors import MlxdError, Overloaded
from mlxd.media.limits import MediaLimits, prepared_media_bytes
from mlxd.media.resolve import resolve_media
from mlxd.models.manager import ManagerPolicy, ModelManager
from mlxd.models.spec import ModelEntry
from mlxd.models.starter import STARTER_STT
from tests.helpers.media_samples import bomb_png, data_url, image, image_part, png
from tests.helpers.memory import MiB, peak_rss, reset_peak_rss, watch
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

pytest.importorskip("av", reason="PyAV is in the `audio` and `vision` extras")

SIDE = 4096  # 16.8 M pixels: 64 MiB as RGB, a 50 KB PNG


def big_png(side: int = SIDE, colour: tuple[int, int, int] = (40, 90, 200)) -> bytes:
    return png(side, side, colour)


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "colour?"}]}]


# -- the request's decoded-pixel total -------------------------------------------------

@contextlib.contextmanager
def watch_memory() -> Iterator[Callable[[], int]]:
    """The growth of this process's peak RSS over the block (call the result after it)."""
    before = reset_peak_rss()
    yield lambda: peak_rss() - before


def test_the_pixel_total_of_a_request_is_a_413_before_the_images_are_decoded() -> None:
    limits = MediaLimits(request_pixels=2 * 64 * 64)
    messages = user(*[image_part(data_url(png(64, 64)))] * 3)
    with pytest.raises(MlxdError) as info:
        asyncio.run(resolve_media(messages, limits))
    err = info.value
    assert (err.status, err.code) == (413, "media_too_many_pixels"), err.message
    assert "8192 decoded pixels" in err.message and "--max-media-pixels" in err.message
    assert err.param is not None and err.param.endswith(".image_url")
    # exactly at the total is fine
    asyncio.run(resolve_media(user(*[image_part(data_url(png(64, 64)))] * 2), limits))


def test_a_pixel_bomb_under_a_raised_per_image_limit_is_refused_by_the_request_total(
        ) -> None:
    # 12000 x 12000 in 100 bytes: 412 MiB as RGB; refused from its header, never decoded
    limits = MediaLimits(image_pixels=10**9)
    with watch_memory() as growth:
        with pytest.raises(MlxdError) as info:
            asyncio.run(resolve_media(user(image_part(data_url(bomb_png(12_000, 12_000)))),
                                      limits))
    assert (info.value.status, info.value.code) == (413, "media_too_many_pixels")
    assert growth() < 32 * MiB, growth() / MiB


def test_sampled_video_frames_count_in_the_pixel_total() -> None:
    from tests.helpers.media_samples import video, video_part

    clip = data_url(video(seconds=2.0, fps=10), "video/mp4")  # 4 frames of 64 x 48
    with pytest.raises(MlxdError) as info:
        asyncio.run(resolve_media(user(video_part(clip)),
                                  MediaLimits(request_pixels=4 * 64 * 48 - 1)))
    assert info.value.code == "media_too_many_pixels"


# -- transient bytes in the ModelManager's budget ----------------------------------------

def never_loads(*args: Any) -> Any:
    raise AssertionError("no model is loaded in these tests")


def manager(budget: int, contention: str = "wait", wait: float = 5.0) -> ModelManager:
    return ModelManager(ManagerPolicy(budget_bytes=budget, contention=contention,
                                      wait_timeout_s=wait), never_loads)


def test_a_hold_that_does_not_fit_beside_another_waits_for_its_release() -> None:
    async def run() -> list[str]:
        m = manager(100)
        order: list[str] = []
        first = await m.transient.hold(60, "A")

        async def second() -> None:
            hold = await m.transient.hold(60, "B")
            order.append("B held")
            await hold.release()

        task = asyncio.create_task(second())
        await asyncio.sleep(0.2)
        order.append(f"A holds {m.transient.held}")
        await first.release()
        await asyncio.wait_for(task, 5)
        assert (m.transient.held, m.transient.holders) == (0, 0)
        return order

    assert asyncio.run(run()) == ["A holds 60", "B held"]


def test_with_contention_fail_a_hold_that_does_not_fit_is_a_503_with_the_numbers() -> None:
    async def run() -> None:
        m = manager(100, contention="fail")
        first = await m.transient.hold(60, "A")
        with pytest.raises(Overloaded) as info:
            await m.transient.hold(60, "this request's decoded audio")
        assert info.value.status == 503 and info.value.code == "memory_budget_full"
        assert "decoded audio need 60 B" in info.value.message, info.value.message
        await first.release()
        await first.release()  # idempotent
        assert m.transient.held == 0

    asyncio.run(run())


def test_one_request_alone_is_never_refused_for_its_own_media() -> None:
    async def run() -> None:
        hold = await manager(100, contention="fail").transient.hold(500, "A")
        await hold.release()

    asyncio.run(run())


# -- a vision model: many large images, and concurrent requests ---------------------------

@pytest.fixture(scope="module")
def vlm(session_dir: Path) -> Path:
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"
    return build_tiny_vlm("qwen2_vl", root / "qwen2_vl", root / "tokenizers")


@pytest.mark.parametrize("family,big,kept", [
    ("qwen2_vl", (7680, 4320), (299, 168)),  # max_pixels 112^2: twice its side
    ("llava", (4000, 3000), (149, 112)),  # shortest edge 56
    ("gemma3", (4000, 1000), (448, 112)),  # 56 x 56 (aspect not kept by the processor)
    ("smolvlm", (1000, 4000), (32, 128)),  # longest edge 64
])
def test_images_far_larger_than_the_processor_uses_are_scaled_to_twice_that(
        session_dir: Path, family: str, big: tuple[int, int], kept: tuple[int, int]) -> None:
    from mlx_vlm import load

    from mlxd.engines.vision.input import decode_image, processor_fit
    from mlxd.media.types import ImageInput
    from tests.helpers.tiny_vlm import build_tiny_vlm

    root = session_dir / "tiny-vlm"
    _, processor = load(str(build_tiny_vlm(family, root / family, root / "tokenizers")))
    fit = processor_fit(processor)
    assert fit is not None
    assert fit(*big) == kept
    assert fit(100, 80) == (100, 80)  # ordinary images reach the processor untouched
    data = image("JPEG", *big)
    item = ImageInput(sha256="", data=data, width=big[0], height=big[1], format="JPEG")
    assert decode_image(item, fit).size == kept


def image_request(n: int, side: int = SIDE) -> dict[str, Any]:
    url = data_url(big_png(side))
    return {"model": "vl", "max_tokens": 1, "temperature": 0,
            "messages": user(*[image_part(url)] * n)}


class HeldBytes:
    """The largest ``manager.transient.held`` seen while the block runs."""

    def __init__(self, srv: RunningServer) -> None:
        self.srv, self.most, self._stop = srv, 0, threading.Event()

    def __enter__(self) -> HeldBytes:
        def poll() -> None:
            while not self._stop.is_set():
                self.most = max(self.most, self.srv.ctx.manager.transient.held)
                time.sleep(0.005)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_request_bytes(n: int, side: int = SIDE) -> int:
    from mlxd.media.types import ImageInput

    image = ImageInput(sha256="", data=b"", width=side, height=side, format="PNG")
    return prepared_media_bytes([image] * n)


@pytest.fixture(scope="module")
def vlm_server(vlm: Path, tmp_path_factory: pytest.TempPathFactory,
               test_home: Path) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("media-budget")
    budget = 64 * MiB + one_request_bytes(4) + MiB  # the model and one request's images
    cfg = registry_config(root / "models.yaml",
                          [ModelEntry(name="vl", source=str(vlm), estimated_memory="64MiB")],
                          test_home, memory_budget=str(budget), max_num_seqs=4,
                          max_media_pixels=4 * SIDE * SIDE)
    with running_server(cfg) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=image_request(1, 64), timeout=120)
        assert r.status_code == 200, r.text  # loaded before anything is measured
        yield srv


def test_many_large_images_are_decoded_one_at_a_time(vlm_server: RunningServer) -> None:
    body = image_request(4)
    with watch(vlm_server.url) as seen:
        started = time.monotonic()
        r = httpx.post(vlm_server.url + "/v1/chat/completions", json=body, timeout=300)
        seconds = time.monotonic() - started
    assert r.status_code == 200, r.text
    print(f"4 x {SIDE}x{SIDE} PNG: peak RSS +{seen.peak_growth / MiB:.0f} MiB, {seconds:.1f} s")
    # one image decoded at a time (64 MiB as RGB, 85 as RGBA...), not all four and
    # their processor copies (about 1 GiB before)
    assert seen.peak_growth < 320 * MiB, seen.peak_growth / MiB


def test_the_request_pixel_total_is_an_openai_413_before_any_decode(
        vlm_server: RunningServer) -> None:
    r = httpx.post(vlm_server.url + "/v1/chat/completions", json=image_request(5, 64 * 8),
                   timeout=60)
    assert r.status_code == 200, r.text  # 5 x 512^2 fits the total
    r = httpx.post(vlm_server.url + "/v1/chat/completions", json=image_request(5), timeout=60)
    assert_openai_error(r, 413, "decoded pixels together")


def test_concurrent_image_requests_wait_for_each_other_in_the_budget(
        vlm_server: RunningServer) -> None:
    body = image_request(4)
    with HeldBytes(vlm_server) as held, watch(vlm_server.url) as seen, \
            cf.ThreadPoolExecutor(3) as pool:
        started = time.monotonic()
        codes = list(pool.map(lambda _: httpx.post(
            vlm_server.url + "/v1/chat/completions", json=body, timeout=300).status_code,
            range(3)))
        seconds = time.monotonic() - started
    assert codes == [200, 200, 200]
    print(f"3 concurrent x 4 images: held at most {held.most / MiB:.0f} MiB, peak RSS "
          f"+{seen.peak_growth / MiB:.0f} MiB, {seconds:.1f} s")
    assert held.most == one_request_bytes(4)  # never two requests' media at once
    assert vlm_server.ctx.manager.transient.held == 0
    metrics = httpx.get(vlm_server.url + "/metrics", timeout=30).text
    assert "mlxd_memory_transient_bytes 0.0" in metrics


# -- a speech-to-text model: concurrent long uploads ---------------------------------------

MINUTES = 20  # 77 MiB of float32 samples at 16 kHz; 9.6 MB as 8-bit 8 kHz WAV


def silent_wav(minutes: float = MINUTES, rate: int = 8000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(rate)
        w.writeframes(b"\x80" * int(minutes * 60 * rate))  # unsigned 8-bit silence
    return out.getvalue()


@pytest.fixture(scope="module")
def stt_server(tmp_path_factory: pytest.TempPathFactory,
               test_home: Path) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("audio-budget")
    samples = 4 * (MINUTES * 60 * 16_000 + 16_000)
    entry = STARTER_STT.model_copy(update={"estimated_memory": 200 * MiB})
    cfg = registry_config(root / "models.yaml", [entry], test_home,
                          memory_budget=str(200 * MiB + samples + MiB))  # one upload's samples
    with running_server(cfg) as srv:
        yield srv


def transcribe(srv: RunningServer, data: bytes) -> httpx.Response:
    return httpx.post(srv.url + "/v1/audio/transcriptions", timeout=300,
                      data={"model": STARTER_STT.name}, files={"file": ("a.wav", data)})


def test_concurrent_long_uploads_wait_for_each_other_in_the_budget(
        stt_server: RunningServer) -> None:
    data = silent_wav()
    assert transcribe(stt_server, silent_wav(0.05)).status_code == 200  # loads the model
    run: Callable[[int], int] = lambda _: transcribe(stt_server, data).status_code  # noqa: E731
    with HeldBytes(stt_server) as held, watch(stt_server.url) as seen, \
            cf.ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        codes = list(pool.map(run, range(4)))
        seconds = time.monotonic() - started
    assert codes == [200] * 4
    samples = 4 * (MINUTES * 60 * 16_000 + 16_000)
    print(f"4 concurrent {MINUTES}-minute uploads: held at most {held.most / MiB:.0f} MiB, "
          f"peak RSS +{seen.peak_growth / MiB:.0f} MiB, {seconds:.1f} s")
    assert held.most == samples
    # the samples of one upload at a time and the upload bodies (709 MiB before)
    assert seen.peak_growth < 3.5 * samples, seen.peak_growth / MiB
    assert stt_server.ctx.manager.transient.held == 0
