"""Images as clients send them: data: URLs and encoded bytes, probed without decoding.

``probe_image`` reads only the header (format, width, height) and refuses an
image over the pixel limit before any pixel is decoded (a 50 KB PNG can
claim 100k x 100k pixels: a decompression bomb); only then does it decode the
image once, so a truncated file is a 400 too. Only the formats vision
processors read are opened, so Pillow's other parsers never see client bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Callable

from mlxd.errors import InvalidRequest
from mlxd.media.limits import human_bytes
from mlxd.media.types import ImageInput

# Pillow's names; MPO is the JPEG variant many phone cameras write (Pillow 13 opens it
# with its JPEG parser and has no "MPO" opener of its own).
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP")
# (pixels, param): counts an image's pixels in its request's total, raising past it
PixelTaker = Callable[[int, str], None]
_HEADER_MAX = 256  # "data:<mime>;<params>," fits in this; the search for "," stops there
_MIME = re.compile(r"[\w.+-]+/[\w.+-]+", re.ASCII)
_SPACE = re.compile(rb"[ \t\r\n]+")


def data_url_size(url: str) -> int:
    """Bytes a ``;base64`` data: URL decodes to, from its length (nothing is copied)."""
    comma = url.find(",", 0, _HEADER_MAX)
    end = len(url)
    while end > comma + 1 and url[end - 1] in "= \t\r\n":
        end -= 1
    return (end - comma - 1) * 3 // 4


def parse_data_url(url: str, param: str, *, kind: str, max_bytes: int) -> tuple[str, bytes]:
    """``(mime type, bytes)`` of a ``data:<mime>;base64,<data>`` URL.

    The size is checked from the base64 length before decoding; the base64 must be
    strict (only its alphabet, correct padding; line breaks are allowed).
    """
    comma = url.find(",", 0, _HEADER_MAX)
    mime, *params = url[5:comma].split(";") if url.startswith("data:") and comma > 0 else ("",)
    if comma < 0 or "base64" not in params or (mime and not _MIME.fullmatch(mime)):
        raise InvalidRequest(f"{param} must be a base64 data: URL "
                             f"(data:{kind}/...;base64,...).", param=param)
    if mime and not mime.startswith(f"{kind}/"):
        raise InvalidRequest(f"{param} is a data: URL of type {mime}, not an {kind}.",
                             param=param)
    if data_url_size(url) > max_bytes:
        raise InvalidRequest(f"{param} is larger than {human_bytes(max_bytes)}.",
                             param=param, code="media_too_large")
    raw = _SPACE.sub(b"", url[comma + 1:].encode("ascii", "replace"))
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{param} is not valid base64.", param=param) from None
    if not data:
        raise InvalidRequest(f"{param} is empty.", param=param)
    return mime, data


def pillow_openers() -> tuple[str, ...]:
    """The ``IMAGE_FORMATS`` this Pillow has an opener for (``Image.open(formats=...)``
    raises ``KeyError`` for a name it has none for, and that name differs by version)."""
    from PIL import Image

    Image.init()
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def probe_image(data: bytes, param: str, *, max_bytes: int, max_pixels: int,
                source: str = "data", request_pixels: PixelTaker | None = None) -> ImageInput:
    """The image's format and size from its header, checked against the limits (and
    taken from the request's ``request_pixels`` before a pixel is decoded)."""
    from PIL import Image  # the vision extra; imported when an image arrives

    if len(data) > max_bytes:
        raise InvalidRequest(f"{param} is larger than {human_bytes(max_bytes)}.",
                             param=param, code="media_too_large")
    try:
        with warnings.catch_warnings():
            # our pixel limit (below) is the bomb check; Pillow's own one only warns
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=pillow_openers())
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, max_pixels) from None
    except Exception:  # any parser failure on client bytes is a 400
        raise InvalidRequest(f"{param} is not an image in a supported format "
                             f"({', '.join(IMAGE_FORMATS)}).", param=param,
                             code="invalid_image") from None
    with image:
        width, height, fmt = image.width, image.height, str(image.format)
        if width < 1 or height < 1:
            raise InvalidRequest(f"{param} has no pixels.", param=param, code="invalid_image")
        if width * height > max_pixels:
            raise _too_many_pixels(param, max_pixels, width, height)
        if request_pixels is not None:
            request_pixels(width * height, param)
        try:
            # Within the limits now: decode once, so a truncated or damaged file is a 400
            # here rather than a failure inside the engine after the model is leased.
            image.load()
        except Exception:
            raise InvalidRequest(f"{param} is a damaged {fmt} image.", param=param,
                                 code="invalid_image") from None
    return ImageInput(sha256=hashlib.sha256(data).hexdigest(), data=data, width=width,
                      height=height, format=fmt, source=source)


def _too_many_pixels(param: str, max_pixels: int, width: int = 0,
                     height: int = 0) -> InvalidRequest:
    size = f" ({width} x {height})" if width else ""
    return InvalidRequest(f"{param} has more than {max_pixels} pixels{size}.", param=param,
                          code="image_too_large")
