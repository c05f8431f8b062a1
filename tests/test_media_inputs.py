"""Images and videos of a conversation resolved before a vision model is leased
(issue 11 item 2): data: URLs, limits checked before any decode, video sampling,
and remote fetches from a local HTTP server (loopback, allowed by the operator's flag;
the SSRF refusals are in test_media_ssrf.py, inside a network namespace)."""

from __future__ import annotations

import asyncio
import base64
import copy
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from mlxd.errors import InvalidRequest, MlxdError, PayloadTooLarge
from mlxd.media.limits import MediaLimits
from mlxd.media.resolve import has_media, resolve_media
from mlxd.media.types import ImageInput, VideoInput
from mlxd.media.video import sample_times
from tests.helpers.media_samples import (
    MediaSite,
    bomb_png,
    data_url,
    image_part,
    png,
    video,
    video_part,
)

LIMITS = MediaLimits()
PNG = png()


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


def resolve(messages: list[dict[str, Any]], limits: MediaLimits = LIMITS) -> list[dict[str, Any]]:
    return asyncio.run(resolve_media(messages, limits))


def refusal(messages: list[dict[str, Any]], limits: MediaLimits = LIMITS) -> MlxdError:
    with pytest.raises(MlxdError) as info:
        resolve(messages, limits)
    return info.value


# -- images -------------------------------------------------------------------------

def test_a_data_url_image_becomes_an_image_input_and_the_request_is_not_changed() -> None:
    messages = user(image_part(data_url(PNG)))
    before = copy.deepcopy(messages)
    out = resolve(messages)
    assert messages == before
    part = out[0]["content"][1]
    assert part["type"] == "image" and isinstance(part["image"], ImageInput)
    image = part["image"]
    assert (image.width, image.height, image.format, image.data) == (32, 24, "PNG", PNG)
    assert image.sha256 == __import__("hashlib").sha256(PNG).hexdigest()
    assert out[0]["content"][0] == {"type": "text", "text": "what is this?"}


def test_garbage_bytes_as_an_image_are_a_400_naming_the_part() -> None:
    err = refusal(user(image_part(data_url(b"not an image at all" * 10))))
    assert isinstance(err, InvalidRequest) and err.status == 400
    assert err.param == "messages[0].content[1].image_url" and err.code == "invalid_image"


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    # 60000 x 60000 claimed by a 100-byte file; Pillow itself would refuse it as a bomb
    err = refusal(user(image_part(data_url(bomb_png()))))
    assert err.status == 400 and "pixels" in err.message
    # under Pillow's own limit but over ours: refused by size before any decode (a
    # decode of this file would fail as "damaged": its rows are missing)
    err = refusal(user(image_part(data_url(bomb_png(3000, 3000)))),
                  replace(LIMITS, image_pixels=1_000_000))
    assert "more than 1000000 pixels (3000 x 3000)" in err.message
    assert err.code == "image_too_large"


def test_a_truncated_image_within_the_limits_is_a_400_not_an_engine_failure() -> None:
    err = refusal(user(image_part(data_url(bomb_png(300, 300)))))
    assert err.status == 400 and "damaged PNG" in err.message


def test_an_oversized_data_url_is_refused_from_its_length_before_decoding() -> None:
    # not even valid base64: a decode would say so; the size check comes first
    url = "data:image/png;base64," + "!" * 4000
    err = refusal(user(image_part(url)), replace(LIMITS, image_bytes=1000))
    assert "larger than 1000 bytes" in err.message and err.code == "media_too_large"


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,iVBOR$$$", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
    ("data:image/png,rawbytes", "base64 data: URL"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("file:file_abc", "file ids are not supported"),
    ("ftp://example.com/a.png", "data: or http(s) URL"),
])
def test_malformed_image_urls_are_400s(url: str, words: str) -> None:
    err = refusal(user(image_part(url)))
    assert err.status == 400 and words in err.message
    assert err.param == "messages[0].content[1].image_url"


def test_line_breaks_inside_base64_are_accepted() -> None:
    body = base64.encodebytes(PNG).decode()  # MIME style: a newline every 76 characters
    out = resolve(user(image_part(f"data:image/png;base64,{body}")))
    assert out[0]["content"][1]["image"].data == PNG


def test_an_image_part_a_client_makes_up_is_refused() -> None:
    err = refusal(user({"type": "image", "image": "http://example.com/x.png"}))
    assert err.param == "messages[0].content[1]" and "image_url" in err.message


def test_too_many_images_are_refused_before_any_is_read() -> None:
    garbage = image_part(data_url(b"garbage"))  # reading any would be a different 400
    err = refusal(user(garbage, garbage, garbage), replace(LIMITS, images_per_request=2))
    assert err.code == "too_many_images" and err.param == "messages[0].content[3].image_url"
    err = refusal(user(video_part(data_url(b"x", "video/mp4"))) * 2,
                  replace(LIMITS, videos_per_request=1))
    assert err.code == "too_many_videos" and err.param == "messages[1].content[1].video_url"


def test_the_request_total_is_a_413_before_decoding() -> None:
    garbage = image_part(data_url(b"g" * 600))
    err = refusal(user(garbage, garbage), replace(LIMITS, request_bytes=1000))
    assert isinstance(err, PayloadTooLarge) and err.status == 413
    assert err.param == "messages[0].content[2].image_url"


def test_text_only_conversations_have_no_media() -> None:
    assert not has_media([{"role": "user", "content": "hi"}])
    assert not has_media(user())
    assert has_media(user(image_part("http://example.com/a.png")))


# -- videos -------------------------------------------------------------------------

def test_sample_times_every_1_over_fps_or_max_frames_spread_evenly() -> None:
    assert sample_times(2.0, 2.0, 64) == [0.0, 0.5, 1.0, 1.5]
    assert sample_times(10.0, 2.0, 4) == [1.25, 3.75, 6.25, 8.75]
    assert sample_times(0.1, 2.0, 64) == [0.0]


def test_a_video_is_sampled_at_the_documented_fps_in_order() -> None:
    out = resolve(user(video_part(data_url(video(seconds=2.0, fps=10), "video/mp4"))))
    clip = out[0]["content"][1]["video"]
    assert isinstance(clip, VideoInput)
    assert (len(clip.frames), clip.fps, clip.seconds) == (4, 2.0, 2.0)
    assert (clip.width, clip.height) == (64, 48) and clip.frames[0].shape == (48, 64, 3)
    # frame i of the source is grey 8*i: samples at 0, 0.5, 1, 1.5 s are frames 0, 5, 10, 15
    greys = [int(f.mean()) for f in clip.frames]
    assert all(abs(g - want) <= 6 for g, want in zip(greys, (0, 40, 80, 120), strict=True))


def test_a_long_video_gets_max_frames_spread_evenly() -> None:
    out = resolve(user(video_part(data_url(video(seconds=2.0, fps=10), "video/mp4"))),
                  replace(LIMITS, video_max_frames=2))
    clip = out[0]["content"][1]["video"]
    assert len(clip.frames) == 2 and clip.fps == 1.0
    greys = [int(f.mean()) for f in clip.frames]  # at 0.5 s and 1.5 s: frames 5 and 15
    assert abs(greys[0] - 40) <= 6 and abs(greys[1] - 120) <= 6


@pytest.mark.parametrize("limit,words", [
    ({"video_seconds": 1.0}, "is 2.0 s long; the limit is 1 s"),
    ({"video_frames": 5}, "has 20 frames; the limit is 5"),
    ({"image_pixels": 1000}, "frames have more than 1000 pixels (64 x 48)"),
    ({"video_bytes": 100}, "larger than 100 bytes"),
])
def test_video_limits_are_refused_from_the_header(limit: dict[str, Any], words: str) -> None:
    clip = data_url(video(seconds=2.0, fps=10), "video/mp4")
    err = refusal(user(video_part(clip)), replace(LIMITS, **limit))
    assert err.status == 400 and words in err.message, err.message
    assert err.param == "messages[0].content[1].video_url"


def test_garbage_as_a_video_is_a_400() -> None:
    err = refusal(user(video_part(data_url(b"\x00garbage" * 100, "video/mp4"))))
    assert err.status == 400 and err.code == "invalid_video"


# -- remote URLs (a loopback site: allowed only with the operator's flag) -----------

@pytest.fixture(scope="module")
def site() -> Iterator[MediaSite]:
    s = MediaSite()
    s.routes["/cat.png"] = (200, {"Content-Type": "image/png"}, PNG)
    s.routes["/clip.mp4"] = (200, {"Content-Type": "video/mp4"}, video(seconds=1.0, fps=4))
    s.routes["/big.png"] = (200, {}, b"x" * 5000)
    s.routes["/stream.png"] = (200, {}, b"x" * 50_000)
    s.chunked.add("/stream.png")
    s.routes["/loop"] = (302, {"Location": "/loop"}, b"")
    yield s
    s.close()


LOOPBACK_OK = replace(LIMITS, allow_private_urls=True)


def test_http_urls_are_fetched_when_private_addresses_are_allowed(site: MediaSite) -> None:
    out = resolve(user(image_part(site.url("/cat.png")), video_part(site.url("/clip.mp4"))),
                  LOOPBACK_OK)
    image, clip = out[0]["content"][1]["image"], out[0]["content"][2]["video"]
    assert image.data == PNG and image.source == site.url("/cat.png")
    assert len(clip.frames) == 2 and clip.source == site.url("/clip.mp4")


def test_a_redirect_is_followed_hop_by_hop(site: MediaSite) -> None:
    target = site.url("/cat.png")
    out = resolve(user(image_part(site.url(f"/redirect?to={target}"))), LOOPBACK_OK)
    assert out[0]["content"][1]["image"].data == PNG
    assert site.seen[-1] == ("/cat.png", f"127.0.0.1:{site.port}")  # Host: the name, kept


def test_a_declared_size_over_the_limit_is_refused_before_reading(site: MediaSite) -> None:
    err = refusal(user(image_part(site.url("/big.png"))), replace(LOOPBACK_OK, image_bytes=1000))
    assert "larger than 1000 bytes" in err.message


def test_a_streamed_body_is_cut_off_at_the_limit(site: MediaSite) -> None:
    err = refusal(user(image_part(site.url("/stream.png"))),
                  replace(LOOPBACK_OK, image_bytes=10_000))
    assert "larger than" in err.message and err.code == "media_too_large"
    err = refusal(user(image_part(site.url("/stream.png"))),
                  replace(LOOPBACK_OK, request_bytes=10_000))
    assert err.status == 413


def test_an_http_error_is_a_400_naming_the_part(site: MediaSite) -> None:
    err = refusal(user(image_part(site.url("/missing.png"))), LOOPBACK_OK)
    assert "HTTP 404" in err.message and err.param == "messages[0].content[1].image_url"


def test_a_redirect_loop_ends(site: MediaSite) -> None:
    err = refusal(user(image_part(site.url("/loop"))), LOOPBACK_OK)
    assert "redirected more than" in err.message


def test_without_the_flag_loopback_is_refused_and_never_connected(site: MediaSite) -> None:
    before = len(site.seen)
    err = refusal(user(image_part(site.url("/cat.png"))))
    assert err.code == "media_url_refused" and "loopback" in err.message
    assert len(site.seen) == before


@pytest.mark.parametrize("part", [
    {"type": "image_url"},
    {"type": "image_url", "image_url": {}},
    {"type": "image_url", "image_url": {"url": 5}},
    {"type": "image_url", "image_url": {"url": ""}},
    {"type": "image_url", "image_url": None},
    {"type": "video_url", "video_url": ["data:video/mp4;base64,AAAA"]},
])
def test_a_media_part_without_a_url_string_is_a_400(part: dict[str, Any]) -> None:
    err = refusal(user(part))
    kind = part["type"]
    assert err.status == 400 and err.param == f"messages[0].content[1].{kind}"
    assert "needs a 'url'" in err.message


def test_a_plain_string_url_is_accepted_as_vllm_does() -> None:
    out = resolve(user({"type": "image_url", "image_url": data_url(PNG)}))
    assert out[0]["content"][1]["image"].data == PNG


@pytest.mark.parametrize("field", ["max_image_bytes", "max_video_bytes", "max_media_bytes",
                                   "max_image_pixels", "max_video_seconds", "max_video_frames",
                                   "video_fps", "video_max_frames", "media_fetch_timeout"])
@pytest.mark.parametrize("value", [0, -1])
def test_media_limits_must_be_positive(field: str, value: int) -> None:
    from pydantic import ValidationError

    from mlxd.config import ServerConfig

    with pytest.raises(ValidationError):
        ServerConfig(**{field: value})


def test_zero_images_per_request_refuses_every_image() -> None:
    err = refusal(user(image_part(data_url(PNG))), replace(LIMITS, images_per_request=0))
    assert err.code == "too_many_images"
