"""Decompression bombs in fetched media (issue 31 item 1).

A media URL's server may answer with ``Content-Encoding: gzip, gzip`` and a few
KB of body that inflate to hundreds of MB. mlxd reads the body raw and undoes the
encoding itself, on a thread, stopping at the image's byte limit, so the bomb is a
400 that says so while peak memory stays flat and /health keeps answering. The
sites here listen on 127.0.0.1 (fetched with the operator's
``--allow-private-media-urls``); the vision model is a config-only folder that is
never loaded.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.errors import MlxdError
from mlxd.media.fetch import decode_content
from mlxd.media.limits import MediaLimits
from mlxd.media.resolve import resolve_media
from mlxd.models.spec import ModelEntry
from tests.helpers.media_samples import (
    MediaSite,
    image_part,
    png,
    servable_vision_engines,
    vision_folder,
)
from tests.helpers.memory import MiB, watch
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server

INSIDE = 200 * MiB  # what the bomb inflates to
LIMITS = MediaLimits(allow_private_urls=True, fetch_timeout=30.0)
PNG = png()
PARAM = "messages[0].content[0].image_url"


def gzip_stream(size: int, chunk: int = MiB) -> bytes:
    """gzip of ``size`` zero bytes, made a chunk at a time (never ``size`` bytes at once)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + 15)
    zeros = bytes(chunk)
    out = [packer.compress(zeros) for _ in range(size // chunk)]
    return b"".join(out) + packer.flush()


def bombs() -> dict[str, tuple[str, bytes]]:
    inner = gzip_stream(INSIDE)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    raw_deflate = b"".join(deflate.compress(bytes(MiB)) for _ in range(INSIDE // MiB))
    return {"/gzip-gzip.png": ("gzip, gzip", gzip.compress(inner, 9)),
            "/gzip.png": ("gzip", inner),
            "/deflate.png": ("deflate", raw_deflate + deflate.flush()),
            "/x-gzip-identity.png": ("x-gzip, identity", inner)}


@pytest.fixture(scope="module")
def site() -> Iterator[MediaSite]:
    s = MediaSite()
    for path, (encoding, body) in bombs().items():
        s.routes[path] = (200, {"Content-Type": "image/png", "Content-Encoding": encoding}, body)
    s.routes["/layered.png"] = (200, {"Content-Encoding": "deflate, gzip"},
                                gzip.compress(zlib.compress(PNG)))
    s.routes["/members.png"] = (200, {"Content-Encoding": "gzip"},
                                gzip.compress(PNG[:50]) + gzip.compress(PNG[50:]))
    s.routes["/brotli.png"] = (200, {"Content-Encoding": "br"}, b"\x0b\x02\x80")
    s.routes["/broken.png"] = (200, {"Content-Encoding": "gzip"}, gzip.compress(PNG)[:-30])
    yield s
    s.close()


def resolve(url: str) -> Any:
    messages = [{"role": "user", "content": [image_part(url)]}]
    return asyncio.run(resolve_media(messages, LIMITS))


def refusal(url: str) -> MlxdError:
    with pytest.raises(MlxdError) as info:
        resolve(url)
    assert info.value.param == PARAM
    return info.value


@pytest.mark.parametrize("path", ["/gzip-gzip.png", "/gzip.png", "/deflate.png",
                                  "/x-gzip-identity.png"])
def test_an_encoded_bomb_is_refused_at_the_image_limit(site: MediaSite, path: str) -> None:
    err = refusal(site.url(path))
    assert err.status == 400 and err.code == "media_too_large", err.message
    assert "once its Content-Encoding" in err.message and "20 MiB" in err.message


def test_layered_encodings_and_gzip_members_are_undone(site: MediaSite) -> None:
    for path in ("/layered.png", "/members.png"):
        image = resolve(site.url(path))[0]["content"][0]["image"]
        assert image.data == PNG and (image.width, image.height) == (32, 24)


def test_an_encoding_the_server_does_not_undo_is_a_400(site: MediaSite) -> None:
    err = refusal(site.url("/brotli.png"))
    assert err.code == "media_fetch_failed" and "'br'" in err.message, err.message


def test_a_damaged_encoding_is_a_400(site: MediaSite) -> None:
    err = refusal(site.url("/broken.png"))
    assert err.code == "media_fetch_failed" and "truncated" in err.message, err.message


def test_the_decoded_size_counts_against_the_request_budget(site: MediaSite) -> None:
    small = replace(LIMITS, request_bytes=len(PNG) - 1)  # the encoded body is smaller
    messages = [{"role": "user", "content": [image_part(site.url("/layered.png"))]}]
    with pytest.raises(MlxdError) as info:
        asyncio.run(resolve_media(messages, small))
    assert info.value.status == 413 and info.value.code == "media_too_large"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, test_home: Path) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("media-bombs")
    cfg = registry_config(root / "models.yaml",
                          [ModelEntry(name="vl", source=str(vision_folder(root)))], test_home,
                          allow_private_media_urls=True)
    with running_server(cfg, engines=servable_vision_engines()) as server:
        yield server


def test_a_gzip_of_gzip_bomb_is_a_400_with_flat_memory_and_a_live_server(
        srv: RunningServer, site: MediaSite) -> None:
    body = {"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "?"}, image_part(site.url("/gzip-gzip.png"))]}]}
    with watch(srv.url) as seen:
        for _ in range(3):
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert_openai_error(r, 400, "once its Content-Encoding (gzip) is undone",
                                "messages[0].content[1].image_url")
    print(f"gzip,gzip bomb ({INSIDE // MiB} MiB inside): peak RSS +"
          f"{seen.peak_growth / MiB:.0f} MiB, slowest /health {seen.slowest_health:.3f} s")
    assert seen.peak_growth < 32 * MiB, seen.peak_growth / MiB
    assert seen.slowest_health < 1.0, seen.health_seconds
    assert srv.ctx.manager.get("vl").loads == 0


def test_decoding_at_the_limit_and_across_pieces() -> None:
    """Each layer streams into the next in 64 KiB pieces: output exactly at the limit is
    kept whole, one byte over is refused, and gzip members split anywhere are joined."""
    data = bytes(range(256)) * 1024  # 256 KiB, several pieces for the outer layer
    layered = gzip.compress(gzip.compress(data[:1000]) + gzip.compress(data[1000:]))
    assert decode_content(layered, ["gzip", "gzip"], len(data), "p") == data
    with pytest.raises(MlxdError) as info:
        decode_content(layered, ["gzip", "gzip"], len(data) - 1, "p")
    assert info.value.code == "media_too_large"
    wrapped = zlib.compress(data)  # "deflate" as the RFC has it, then as raw deflate
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    for body in (wrapped, raw.compress(data) + raw.flush()):
        assert decode_content(body, ["deflate"], len(data), "p") == data
