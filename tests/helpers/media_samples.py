"""Images, videos and a never-loaded vision model for the media tests (issue 11 item 2)."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from dataclasses import replace
from pathlib import Path

from mlxd.engines.registry import ENGINES, EngineRegistry
from mlxd.models.spec import ModelKind

QWEN2_VL_CONFIG = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                   "vision_config": {"depth": 2}, "max_position_embeddings": 2048}


def png(width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(
        ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def bomb_png(width: int = 60_000, height: int = 60_000) -> bytes:
    """A well-formed PNG header claiming ``width x height`` pixels with a few bytes of data:
    decoding it would allocate width*height*3 bytes (10 GB by default) or fail on the
    missing rows; a header probe refuses it first."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b""))


def image(fmt: str, width: int = 40, height: int = 30,
          color: tuple[int, int, int] = (30, 160, 90)) -> bytes:
    """A solid-colour image in Pillow's format ``fmt`` (PNG, JPEG, MPO, WEBP, GIF, BMP)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, fmt)
    return out.getvalue()


def video(seconds: float = 2.0, fps: int = 10, width: int = 64, height: int = 48,
          container_format: str = "mp4", codec: str = "mpeg4",
          pix_fmt: str = "yuv420p") -> bytes:
    """A video whose frame i is solid grey level 8*i (PyAV's own encoders; MPEG-4 in MP4
    unless ``container_format`` / ``codec`` say otherwise)."""
    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(round(seconds * fps)):
            rgb = np.full((height, width, 3), (8 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict[str, object]:
    return {"type": "video_url", "video_url": {"url": url}}


def vision_folder(root: Path) -> Path:
    """A qwen2_vl model folder with a config only: detected as vision, never loadable."""
    folder = root / "tiny-vl-config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_VL_CONFIG))
    return folder


def servable_vision_engines() -> EngineRegistry:
    """The default registry, with vision servable even before this install has its engine,
    so requests reach the media checks; the tests using it never let a model load."""
    spec = ENGINES[ModelKind.VISION]
    if spec.engine is None:
        spec = replace(spec, engine="mlxd.engines.text.engine:MLXLanguageModel", extra=None)
    return EngineRegistry(specs={**ENGINES, ModelKind.VISION: spec})


class MediaSite:
    """A small HTTP server for fetch tests: ``routes`` maps a path to (status, headers,
    body); ``/redirect?to=URL`` answers 302 to URL; every request's path and Host header
    is recorded in ``seen``. ``chunked`` paths stream without a Content-Length."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        import http.server
        import threading
        from urllib.parse import parse_qs, urlsplit

        site = self
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.chunked: set[str] = set()
        self.seen: list[tuple[str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                site.seen.append((self.path, self.headers.get("Host", "")))
                parts = urlsplit(self.path)
                if parts.path == "/redirect":
                    target = parse_qs(parts.query)["to"][0]
                    self._send(302, {"Location": target}, b"")
                    return
                status, headers, body = site.routes.get(parts.path, (404, {}, b"no"))
                if parts.path in site.chunked:
                    self.send_response(status)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(body), 4096):
                        piece = body[i:i + 4096]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self._send(status, headers, body)

            def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host = host
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TLSSite:
    """An https server whose certificate names only ``name``; serves ``body`` to every GET
    and records the TLS SNI and Host header of each request in ``seen``."""

    def __init__(self, folder: Path, host: str, body: bytes,
                 name: str = "images.example") -> None:
        import socket
        import ssl
        import threading

        cert, key = _self_signed(folder, name)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.seen: list[str] = []
        context.sni_callback = self._sni  # type: ignore[assignment]
        self.trust = ssl.create_default_context(cafile=str(cert))
        self.listener = socket.create_server((host, 0))
        self.port = int(self.listener.getsockname()[1])
        self.body, self.context = body, context
        threading.Thread(target=self._serve, daemon=True).start()

    def _sni(self, sock: object, sni: str | None, ctx: object) -> None:
        self.seen.append(f"sni:{sni}")

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    head = tls.recv(65536).decode()
                    self.seen.append(next(h for h in head.split("\r\n") if h.startswith("Host:")))
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(self.body), self.body))
            except (OSError, StopIteration):
                pass  # a client that refused the certificate

    def close(self) -> None:
        self.listener.close()


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for ``name``, with cryptography (mlx-vlm's)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return folder / "cert.pem", folder / "key.pem"
