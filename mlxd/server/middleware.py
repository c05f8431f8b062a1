"""ASGI middleware: Host check, request body limit and API-key authentication."""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The playground's page and static files are public too: they hold no data, and the
# page asks for the key itself when the API answers 401 (server/routes/playground.py).
PUBLIC_PATHS = frozenset({"/health", "/healthz", "/", "/ui", "/favicon.ico"})
PUBLIC_PREFIXES = ("/ui/",)
ADMIN_ROUTES = (("POST", "/v1/models/load"), ("POST", "/v1/models/unload"),
                ("PUT", "/v1/models"), ("DELETE", "/v1/models/"),
                ("POST", "/api/pull"), ("DELETE", "/api/delete"))


def _error_payload(path: str, status: int, message: str, kind: str) -> bytes:
    if path.startswith("/api/"):  # Ollama's shape
        body: dict[str, Any] = {"error": message}
    elif path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return json.dumps(body).encode()


async def _send_error(send: Send, path: str, status: int, message: str, kind: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = _error_payload(path, status, message, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413 before they are parsed; a path in
    ``per_path`` has its own limit instead (audio uploads follow --max-audio-upload-bytes,
    which their multipart reader enforces exactly)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_bytes = max_bytes
        self.per_path = dict(per_path or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        max_bytes = self.per_path.get(path, self.default_bytes)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > max_bytes:
                        await _send_error(send, path, 413,
                                          f"Request body of {int(value)} bytes exceeds the limit "
                                          f"of {max_bytes} bytes.", "request_too_large")
                        return
                except ValueError:
                    pass
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await _send_error(send, path, 413, f"Request body exceeds the limit of "
                                               f"{max_bytes} bytes.", "request_too_large")


class _BodyTooLarge(Exception):
    pass


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def _is_admin(method: str, path: str) -> bool:
    return any(method == m and (path == p or (p.endswith("/") and path.startswith(p)))
               for m, p in ADMIN_ROUTES)


class AuthMiddleware:
    """Every route but /health and the playground's files needs the API key (Bearer or
    x-api-key) when one is set.

    Admin routes need the admin key when one is configured. Keys are compared
    in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key

    @staticmethod
    def _presented(scope: Scope) -> str | None:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                text = value.decode("latin-1")
                if text.lower().startswith("bearer "):
                    return text[7:].strip()
            elif name == b"x-api-key":
                return value.decode("latin-1").strip()
        return None

    @staticmethod
    def _matches(presented: str | None, expected: str) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode("utf-8"), expected.encode("utf-8"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_public(scope.get("path", "")) or \
                scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "")
        presented = self._presented(scope)
        if _is_admin(method, path) and self.admin_key:
            if not self._matches(presented, self.admin_key):
                await _send_error(send, path, 403 if presented else 401,
                                  "This admin route needs the admin API key.",
                                  "permission_error" if presented else "authentication_error")
                return
        elif self.api_key and not (self._matches(presented, self.api_key) or
                                   (self.admin_key and self._matches(presented, self.admin_key))):
            await _send_error(send, path, 401,
                              "Missing or invalid API key. Send 'Authorization: Bearer KEY' "
                              "or 'x-api-key: KEY'.", "authentication_error",
                              [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


# Host names every server answers to: this machine, by name or loopback address.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
HOST_CHECK_EXEMPT = frozenset({"/health", "/healthz"})  # probes send the pod's address


def host_of(header: str) -> str:
    """The host of a ``Host`` header, without its port, lower case, no trailing dot."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(configured: Iterable[str] | None, api_key: str | None,
                  bind: str) -> frozenset[str] | None:
    """The host names a server answers to (None: any). Without ``--allowed-hosts`` a server
    with no API key answers to loopback names only (and the address it is bound to, when
    not a wildcard), so a web page cannot reach it through DNS rebinding; a server with
    an API key answers to any. ``*`` among them turns the check off."""
    if configured is None:
        if api_key:
            return None
        configured = ()
    names = {host_of(h) for h in configured if h.strip()}
    if "*" in names:
        return None
    bound = host_of(bind)
    if bound not in ("", "0.0.0.0", "::"):
        names.add(bound)
    return frozenset(names)


class HostCheckMiddleware:
    """Refuse (400, in the API's error shape) a request whose ``Host`` header names a host
    this server does not answer to: loopback names and ``allowed``. A request without a
    Host header (HTTP/1.0: no browser sends one) passes."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or \
                scope.get("path", "") in HOST_CHECK_EXEMPT:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for n, v in scope.get("headers", [])
                       if n == b"host"), None)
        host = host_of(header) if header is not None else None
        if host is None or _is_loopback(host) or host in self.allowed:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _send_error(send, scope.get("path", ""), 400,
                          f"Host '{host[:100]}' is not allowed: without an API key this server "
                          "answers only to localhost and the names given to --allowed-hosts "
                          "(a guard against DNS rebinding).", "invalid_request_error")
