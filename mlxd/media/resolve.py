"""Resolve the images and videos of a conversation before a vision model is leased.

Every ``image_url`` / ``video_url`` part (OpenAI's shape; the Anthropic and
Responses adapters produce the same parts) becomes ``{"type": "image",
"image": ImageInput}`` / ``{"type": "video", "video": VideoInput}``
(``types.py``). The order of the checks is the point:

1. counts (images, videos per request) and URL schemes, from the JSON alone;
2. the size of every data: URL from its base64 length, against the per-item and
   the per-request byte limits, before any base64 is decoded;
3. remote URLs fetched concurrently (a few at a time) under the SSRF guard,
   size-capped while streaming, sharing the request's byte budget;
4. then probing (image headers) and video decoding, off the event loop, each image's
   pixels counted against the request's decoded-pixel total before it is decoded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from mlxd.errors import InvalidRequest
from mlxd.media.fetch import ByteBudget, MediaFetcher
from mlxd.media.images import data_url_size, parse_data_url, probe_image
from mlxd.media.limits import MediaLimits, PixelBudget, human_bytes
from mlxd.media.types import IMAGE_PART, VIDEO_PART, ImageInput, VideoInput
from mlxd.media.video import decode_video

FETCH_CONCURRENCY = 4  # remote fetches of one request at a time
# Images and videos of one request decoded at a time: an 8K image is 130 MB decoded, and
# a request may carry 32 of them.
DECODE_CONCURRENCY = 1
MediaKind = Literal["image", "video"]
_URL_PARTS: dict[str, MediaKind] = {"image_url": "image", "video_url": "video"}
T = TypeVar("T")
FetcherFactory = Callable[[MediaLimits], MediaFetcher]


@dataclass
class MediaRef:
    """One media part found in the messages, by position."""

    message: int
    part: int
    kind: MediaKind
    url: str
    param: str  # e.g. messages[1].content[2].image_url


def has_media(messages: list[dict[str, Any]]) -> bool:
    """Whether any message has an image or video part to resolve (cheap; no parsing)."""
    return any(isinstance(p, dict) and p.get("type") in _URL_PARTS
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def find_media(messages: list[dict[str, Any]]) -> list[MediaRef]:
    """Every image/video URL part in order; refuses parts that cannot be resolved."""
    refs: list[MediaRef] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in (IMAGE_PART, VIDEO_PART) and not isinstance(
                    part.get(kind), ImageInput | VideoInput):
                raise InvalidRequest(f"{where}: send images as 'image_url' parts and videos "
                                     "as 'video_url' parts.", param=where)
            if kind in _URL_PARTS:
                refs.append(MediaRef(i, j, _URL_PARTS[kind], _url_of(part, kind, where),
                                     f"{where}.{kind}"))
    return refs


def _url_of(part: dict[str, Any], key: str, where: str) -> str:
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.{key} needs a 'url' (a data: or http(s) URL).",
                             param=f"{where}.{key}")
    return url


def _item_limit(ref: MediaRef, limits: MediaLimits) -> int:
    return limits.image_bytes if ref.kind == "image" else limits.video_bytes


def check_counts(refs: list[MediaRef], limits: MediaLimits) -> None:
    """Images and videos per request, and each URL's scheme, before anything is read."""
    for kind, most in (("image", limits.images_per_request),
                       ("video", limits.videos_per_request)):
        mine = [r for r in refs if r.kind == kind]
        if len(mine) > most:
            raise InvalidRequest(f"This request has {len(mine)} {kind}s; the limit is {most} "
                                 "per request.", param=mine[most].param,
                                 code=f"too_many_{kind}s")
    for ref in refs:
        scheme = ref.url.partition(":")[0].lower()
        if scheme == "file":
            raise InvalidRequest(f"{ref.param}: file ids are not supported; send the {ref.kind} "
                                 "as a data: URL or an http(s) URL.", param=ref.param)
        if scheme not in ("data", "http", "https"):
            raise InvalidRequest(f"{ref.param} must be a data: or http(s) URL.", param=ref.param)


def check_inline_sizes(refs: list[MediaRef], limits: MediaLimits, budget: ByteBudget) -> None:
    """Each data: URL's decoded size, from its length alone, against both byte limits."""
    for ref in refs:
        if not ref.url.startswith("data:"):
            continue
        size = data_url_size(ref.url)
        if size > _item_limit(ref, limits):
            raise InvalidRequest(f"{ref.param} is larger than "
                                 f"{human_bytes(_item_limit(ref, limits))}.", param=ref.param,
                                 code="media_too_large")
        budget.take(size, ref.param)


def _decode(ref: MediaRef, data: bytes, limits: MediaLimits, source: str,
            pixels: PixelBudget) -> dict[str, Any]:
    """The resolved part for ``data`` (runs on a worker thread)."""
    if ref.kind == "image":
        image = probe_image(data, ref.param, max_bytes=limits.image_bytes,
                            max_pixels=limits.image_pixels, source=source,
                            request_pixels=pixels.take)
        return {"type": IMAGE_PART, IMAGE_PART: image}
    clip = decode_video(data, ref.param, limits, source)
    pixels.take(sum(int(f.shape[0]) * int(f.shape[1]) for f in clip.frames), ref.param)
    return {"type": VIDEO_PART, VIDEO_PART: clip}


async def _resolve_one(ref: MediaRef, limits: MediaLimits, fetcher: MediaFetcher | None,
                       budget: ByteBudget, pixels: PixelBudget,
                       gate: asyncio.Semaphore, decoding: asyncio.Semaphore) -> dict[str, Any]:
    if ref.url.startswith("data:"):
        _, data = await asyncio.to_thread(parse_data_url, ref.url, ref.param, kind=ref.kind,
                                          max_bytes=_item_limit(ref, limits))
        source = "data"
    else:
        assert fetcher is not None  # made for every request with a remote URL
        async with gate:
            fetched = await fetcher.fetch(ref.url, max_bytes=_item_limit(ref, limits),
                                            param=ref.param, budget=budget)
        data, source = fetched.data, ref.url
    async with decoding:
        return await asyncio.to_thread(_decode, ref, data, limits, source, pixels)


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; the first failure cancels the rest and is raised as itself."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def default_fetcher(limits: MediaLimits) -> MediaFetcher:
    return MediaFetcher(timeout=limits.fetch_timeout, allow_private=limits.allow_private_urls)


async def resolve_media(messages: list[dict[str, Any]], limits: MediaLimits, *,
                        make_fetcher: FetcherFactory = default_fetcher) -> list[dict[str, Any]]:
    """New messages with every image/video part resolved; ``messages`` is not changed."""
    refs = find_media(messages)
    if not refs:
        return messages
    check_counts(refs, limits)
    budget = ByteBudget(limits.request_bytes)
    pixels = PixelBudget(limits.request_pixels)
    check_inline_sizes(refs, limits, budget)
    fetcher = None
    if any(not r.url.startswith("data:") for r in refs):
        # one client per request; made off the loop (loading CA certificates blocks)
        fetcher = await asyncio.to_thread(make_fetcher, limits)
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)
    decoding = asyncio.Semaphore(DECODE_CONCURRENCY)
    try:
        parts = await _all([_resolve_one(r, limits, fetcher, budget, pixels, gate, decoding)
                            for r in refs])
    finally:
        if fetcher is not None:
            await fetcher.aclose()
    return _replaced(messages, refs, parts)


def _replaced(messages: list[dict[str, Any]], refs: list[MediaRef],
              parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    for ref, part in zip(refs, parts, strict=True):
        content = out[ref.message]["content"]
        if content is messages[ref.message]["content"]:
            content = out[ref.message]["content"] = list(content)
        content[ref.part] = part
    return out
