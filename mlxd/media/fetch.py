"""Fetch an image or video URL for a request, without becoming an SSRF proxy.

A client's URL is fetched only over http(s), with a deadline, size-capped
while streaming (and by the request's shared byte budget). Redirects are
followed here, one hop at a time, and every hop's host is resolved and
checked: private, loopback, link-local, multicast, reserved and unspecified
addresses (IPv4 and IPv6, including IPv4 inside IPv6) are refused unless the
operator allows them (``--allow-private-media-urls``). The connection goes to
the very address that was checked (the URL's host is replaced by it; Host
header and TLS SNI keep the name), so a DNS answer that changes between the
check and the connect (rebinding) cannot redirect it.

The body is read as sent and a ``Content-Encoding`` (gzip, deflate, layered) is
undone here, off the event loop, under the same size limit as the body: a
client library that decodes for us would inflate a small bomb before any check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx

from mlxd.errors import InvalidRequest, PayloadTooLarge
from mlxd.media.limits import human_bytes

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to (tests inject their own)
Resolver = Callable[[str, int], Awaitable[list[str]]]

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
USER_AGENT = "mlxd-media-fetch"


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the event loop's getaddrinfo, off the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo client, NAT64), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def blocked_reason(ip: IPAddress) -> str | None:
    """Why a media URL may not reach ``ip`` (None: a public address it may reach)."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None and blocked_reason(inner):
            return f"{blocked_reason(inner)} (inside {ip})"
    for name in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{name}"):
            return f"a {name.replace('_', '-')} address"
    if not ip.is_global:  # shared (100.64/10), documentation and other special ranges
        return "not a public address"
    return None


class ByteBudget:
    """Bytes every image and video of one request may take together (413 past it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int, param: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise PayloadTooLarge(
                f"The images and videos of this request exceed {human_bytes(self.limit)} "
                f"together (at {param}).", param=param, code="media_too_large")


@dataclass(frozen=True)
class Fetched:
    data: bytes
    url: str  # the final URL, after redirects
    content_type: str | None


class MediaFetcher:
    """Fetches client-given media URLs under the SSRF guard; one per request."""

    def __init__(self, *, timeout: float, allow_private: bool = False,
                 resolver: Resolver | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        self.timeout = timeout
        self.allow_private = allow_private
        self.resolver = resolver or system_resolver
        # trust_env=False: an environment proxy would connect somewhere other than the
        # address checked here.
        self.client = httpx.AsyncClient(timeout=timeout, follow_redirects=False,
                                        trust_env=False, transport=transport, verify=verify)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str, *, max_bytes: int, param: str,
                    budget: ByteBudget | None = None) -> Fetched:
        """The body at ``url`` (at most ``max_bytes``); any refusal is a 4xx naming ``param``."""
        try:
            return await asyncio.wait_for(self._follow(url, max_bytes, param, budget),
                                          self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise InvalidRequest(f"Fetching {param} timed out after {self.timeout:g} s.",
                                 param=param, code="media_fetch_failed") from None
        except httpx.HTTPError as e:
            raise InvalidRequest(f"Could not fetch {param}: {type(e).__name__}.",
                                 param=param, code="media_fetch_failed") from None

    async def _follow(self, url: str, max_bytes: int, param: str,
                      budget: ByteBudget | None) -> Fetched:
        for _ in range(MAX_REDIRECTS + 1):
            target = _parse(url, param)
            request = await self._pinned_request(target, param)
            response = await self.client.send(request, stream=True)
            try:
                location = response.headers.get("location")
                if response.status_code in _REDIRECTS and location:
                    url = str(target.join(location))
                    continue
                if response.status_code != 200:
                    raise InvalidRequest(
                        f"Could not fetch {param}: the server answered HTTP "
                        f"{response.status_code}.", param=param, code="media_fetch_failed")
                data = await _read_capped(response, max_bytes, param, budget)
                return Fetched(data, str(target), response.headers.get("content-type"))
            finally:
                await response.aclose()
        raise InvalidRequest(f"Fetching {param} was redirected more than {MAX_REDIRECTS} times.",
                             param=param, code="media_fetch_failed")

    async def _pinned_request(self, url: httpx.URL, param: str) -> httpx.Request:
        """A request to the checked address of ``url``'s host, naming the host in Host/SNI."""
        host = url.host
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addresses = await self.resolver(host, port)
        except OSError:
            raise InvalidRequest(f"Could not resolve the host of {param} ({host}).",
                                 param=param, code="media_fetch_failed") from None
        if not addresses:
            raise InvalidRequest(f"The host of {param} ({host}) has no address.",
                                 param=param, code="media_fetch_failed")
        ips = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addresses]
        if not self.allow_private:
            for ip in ips:  # every answer: a round-robin name may not hide a private one
                why = blocked_reason(ip)
                if why:
                    raise InvalidRequest(
                        f"{param} points to {host} ({ip}), {why}; media URLs must be public "
                        "(the server's operator can allow others with "
                        "--allow-private-media-urls).", param=param, code="media_url_refused")
        headers = {"Host": url.netloc.decode("ascii"), "User-Agent": USER_AGENT,
                   "Accept": "image/*, video/*, */*;q=0.5", "Accept-Encoding": "identity"}
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        return self.client.build_request("GET", url.copy_with(host=str(ips[0])),
                                         headers=headers, extensions=extensions)


def _parse(url: str, param: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise InvalidRequest(f"{param} is not a valid URL.", param=param) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidRequest(f"{param} must be an http(s) or data: URL.", param=param)
    if parsed.userinfo:
        raise InvalidRequest(f"{param} must not carry credentials.", param=param)
    return parsed


async def _read_capped(response: httpx.Response, max_bytes: int, param: str,
                       budget: ByteBudget | None) -> bytes:
    """The body, refused as soon as it passes ``max_bytes`` (declared, streamed or decoded).

    The bytes are read raw: httpx would undo a ``Content-Encoding`` chunk by chunk with
    no bound on the output (3 KB of ``gzip, gzip`` is gigabytes), on the event loop.
    ``decode_content`` undoes it here, on a thread, stopping at the same limit.
    """
    encodings = content_encodings(response.headers.get_list("content-encoding"), param)
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(param, max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():  # as sent: never decoded by httpx
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(param, max_bytes)
        if budget is not None:
            budget.take(len(chunk), param)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not encodings:
        return raw
    data = await asyncio.to_thread(decode_content, raw, encodings, max_bytes, param)
    if budget is not None:
        budget.take(max(0, len(data) - len(raw)), param)
    return data


# Content-Encoding names we undo, with zlib's wbits for each (gzip header; zlib header or
# raw deflate, which servers send for "deflate" alike).
_ZLIB_WBITS = {"gzip": 16 + 15, "x-gzip": 16 + 15, "deflate": 0}
_DECODE_STEP = 64 * 1024  # output bytes per decompress call


def content_encodings(values: list[str], param: str) -> list[str]:
    """The encodings of ``Content-Encoding`` header values in the order they were applied
    (``identity`` left out); a 400 for one this server does not undo."""
    names = [n.strip().lower() for v in values for n in v.split(",") if n.strip()]
    names = [n for n in names if n != "identity"]
    for name in names:
        if name not in _ZLIB_WBITS:
            raise InvalidRequest(
                f"Could not fetch {param}: the server sent it with Content-Encoding {name!r}; "
                "this server accepts identity, gzip and deflate.", param=param,
                code="media_fetch_failed")
    return names


def decode_content(raw: bytes, encodings: list[str], max_bytes: int, param: str) -> bytes:
    """``raw`` with ``encodings`` undone, last applied first; a 413-style 400 as soon as any
    layer's output passes ``max_bytes``.

    The layers are undone as a chain of streams, twice: first only counting (a bomb is
    refused having held one step of output, never ``max_bytes`` of it), then keeping
    what is now known to fit."""
    for _ in _decoded(raw, encodings, max_bytes, param):
        pass
    return b"".join(_decoded(raw, encodings, max_bytes, param))


def _decoded(raw: bytes, encodings: list[str], max_bytes: int, param: str) -> Iterator[bytes]:
    stream: Iterator[bytes] = iter((raw,))
    for name in reversed(encodings):
        stream = _inflate(stream, _ZLIB_WBITS[name], max_bytes, param, name)
    return stream


def _inflate(source: Iterator[bytes], wbits: int, max_bytes: int, param: str,
             name: str) -> Iterator[bytes]:
    """One layer undone as a stream, at most ``_DECODE_STEP`` bytes per call (gzip members
    in turn); its whole output may not pass ``max_bytes``."""
    pending = b""
    if wbits == 0:  # "deflate": zlib-wrapped per the RFC, raw deflate from some servers
        for piece in source:
            pending += piece
            if len(pending) > 1:
                break
        zlib_header = len(pending) > 1 and pending[0] & 0x0F == 8 and int.from_bytes(
            pending[:2], "big") % 31 == 0
        wbits = 15 if zlib_header else -15
    inflater = zlib.decompressobj(wbits)
    total = 0
    try:
        while True:
            if inflater.eof:
                if wbits <= 16:
                    return  # one zlib/deflate stream; what follows it is not image data
                pending = inflater.unused_data or next(source, b"")
                while not pending:  # another gzip member may follow, maybe in a later piece
                    more = next(source, None)
                    if more is None:
                        return
                    pending = more
                inflater = zlib.decompressobj(wbits)
                continue
            if pending:
                chunk = inflater.decompress(pending, _DECODE_STEP)
                pending = inflater.unconsumed_tail
            else:  # zlib may still hold output for input it has taken
                chunk = inflater.decompress(b"", _DECODE_STEP)
                if not chunk:
                    more = next(source, None)
                    if more is None:
                        raise InvalidRequest(
                            f"Could not fetch {param}: its {name} encoding is truncated.",
                            param=param, code="media_fetch_failed")
                    pending = more
            if chunk:
                total += len(chunk)
                if total > max_bytes:
                    raise InvalidRequest(
                        f"{param} is larger than {human_bytes(max_bytes)} once its "
                        f"Content-Encoding ({name}) is undone.", param=param,
                        code="media_too_large")
                yield chunk
    except zlib.error:
        raise InvalidRequest(f"Could not fetch {param}: its {name} encoding is damaged.",
                             param=param, code="media_fetch_failed") from None


def _too_large(param: str, max_bytes: int) -> InvalidRequest:
    return InvalidRequest(f"{param} is larger than {human_bytes(max_bytes)}.", param=param,
                          code="media_too_large")
