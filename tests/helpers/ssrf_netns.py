"""SSRF checks, run inside a network namespace of their own (tests/test_media_ssrf.py).

Run only as ``unshare -n sh -c 'ip link set lo up; ip addr add ... dev lo;
python -m tests.helpers.ssrf_netns'``: the namespace's loopback carries
10.1.2.3, 169.254.169.254 and 1.1.1.1 (a public address standing in for a
media site), and has no other interface, so even a broken guard cannot send a
packet to a real private or link-local host. A tripwire listens on each
forbidden address; any connection to one fails the run. Prints one JSON object:
check name -> "ok" or the failure.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.errors import MlxdError
from mlxd.media.fetch import MediaFetcher
from mlxd.media.limits import MediaLimits
from mlxd.media.resolve import resolve_media
from tests.helpers.media_samples import MediaSite, TLSSite, image_part, png, vision_folder

PUBLIC = "1.1.1.1"  # only on this namespace's loopback
FORBIDDEN = ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1")
LIMITS = MediaLimits(fetch_timeout=5.0)
PARAM = "messages[0].content[1].image_url"


class Tripwires:
    """A listener on port 80 of every forbidden address; records whoever connects."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        for host in FORBIDDEN:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 80))
            sock.listen()
            threading.Thread(target=self._watch, args=(sock, host), daemon=True).start()

    def _watch(self, sock: socket.socket, host: str) -> None:
        while True:
            conn, _ = sock.accept()
            self.hits.append(host)
            conn.close()


def refused(url: str, make_fetcher: Callable[[MediaLimits], MediaFetcher] | None = None) -> str:
    """The refusal resolving an image at ``url`` gets (fails if it resolves)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "?"}, image_part(url)]}]
    kw: dict[str, Any] = {"make_fetcher": make_fetcher} if make_fetcher else {}
    try:
        asyncio.run(resolve_media(messages, LIMITS, **kw))
    except MlxdError as e:
        assert e.status == 400 and e.param == PARAM, (e.status, e.param, e.message)
        return e.message
    raise AssertionError(f"{url} was fetched")


def fake_resolver(*answers: list[str]) -> tuple[Callable[..., Any], list[str]]:
    """A resolver giving ``answers`` in turn (the last one ever after), recording hosts."""
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls), len(answers)) - 1]

    return resolve, calls


def checks(site: MediaSite) -> dict[str, Callable[[], None]]:
    def direct(url: str, words: str) -> Callable[[], None]:
        def check() -> None:
            message = refused(url)
            assert "--allow-private-media-urls" in message and words in message, message
        return check

    def redirect(target: str) -> Callable[[], None]:
        def check() -> None:
            before = len(site.seen)
            refused(f"http://{PUBLIC}/redirect?to={target}")
            assert len(site.seen) == before + 1, "the first hop was not even made"
        return check

    def public_fetch() -> None:
        out = asyncio.run(resolve_media(
            [{"role": "user", "content": [image_part(f"http://{PUBLIC}/cat.png")]}], LIMITS))
        assert out[0]["content"][0]["image"].data == site.routes["/cat.png"][2]

    def pinned_address() -> None:
        # the name resolves once; a later answer (rebinding) is never used for the connect
        resolver, calls = fake_resolver([PUBLIC], ["10.1.2.3"])
        out = asyncio.run(resolve_media(
            [{"role": "user", "content": [image_part("http://images.example/cat.png")]}], LIMITS,
            make_fetcher=lambda lim: MediaFetcher(timeout=5.0, resolver=resolver)))
        assert out[0]["content"][0]["image"].source == "http://images.example/cat.png"
        assert calls == ["images.example"] and site.seen[-1] == ("/cat.png", "images.example")

    def any_private_answer() -> None:
        resolver, _ = fake_resolver([PUBLIC, "10.1.2.3"])
        refused("http://images.example/cat.png",
                lambda lim: MediaFetcher(timeout=5.0, resolver=resolver))

    def https_pinned() -> None:
        # the connection goes to the checked address while TLS checks the name (SNI, cert)
        tls = TLSSite(Path(tempfile.mkdtemp(prefix="tls-")), PUBLIC, site.routes["/cat.png"][2])
        resolver, _ = fake_resolver([PUBLIC])

        def fetcher(limits: MediaLimits) -> MediaFetcher:
            return MediaFetcher(timeout=5.0, resolver=resolver, verify=tls.trust)

        try:
            url = f"https://images.example:{tls.port}/cat.png"
            out = asyncio.run(resolve_media(
                [{"role": "user", "content": [image_part(url)]}], LIMITS, make_fetcher=fetcher))
            assert out[0]["content"][0]["image"].data == site.routes["/cat.png"][2]
            assert tls.seen[-2:] == ["sni:images.example", f"Host: images.example:{tls.port}"]
            # a name the certificate does not carry fails verification: it is not skipped
            message = refused(f"https://other.example:{tls.port}/cat.png", fetcher)
            assert "Could not fetch" in message, message
        finally:
            tls.close()

    return {
        "https_to_the_checked_address_with_the_name_verified": https_pinned,
        "loopback": direct("http://127.0.0.1/cat.png", "loopback"),
        "private_10_8": direct("http://10.1.2.3/cat.png", "private"),
        "link_local_metadata": direct("http://169.254.169.254/latest/meta-data/", "link-local"),
        "loopback_ipv6": direct("http://[::1]/cat.png", "loopback"),
        "ipv4_mapped_ipv6": direct("http://[::ffff:169.254.169.254]/x", "link-local"),
        "localhost_by_name": direct("http://localhost/cat.png", "loopback"),
        "redirect_to_loopback": redirect("http://127.0.0.1/cat.png"),
        "redirect_to_private": redirect("http://10.1.2.3/cat.png"),
        "redirect_to_metadata": redirect("http://169.254.169.254/latest/meta-data/"),
        "public_fetch_works": public_fetch,
        "connects_to_the_checked_address": pinned_address,
        "any_private_answer_refuses": any_private_answer,
    }


def server_checks() -> dict[str, Callable[[], None]]:
    """The same refusals through a real mlxd server, in each API's shape; never a load."""
    import httpx

    from mlxd.models.spec import ModelEntry
    from tests.helpers.media_samples import servable_vision_engines
    from tests.helpers.retrieval import registry_config
    from tests.helpers.server import running_server

    root = Path(tempfile.mkdtemp(prefix="ssrf-"))
    home = root / "home"
    home.mkdir()
    cfg = registry_config(root / "models.yaml",
                          [ModelEntry(name="vl", source=str(vision_folder(root)))], home)
    results: dict[str, Callable[[], None]] = {}
    image = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}}
    bodies = {
        "server_chat_metadata": ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "?"}, image]}]}),
        "server_anthropic_private": ("/v1/messages", {"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://10.1.2.3/cat.png"}}]}]}),
        "server_responses_redirect": ("/v1/responses", {"input": [
            {"role": "user", "content": [{"type": "input_image", "image_url":
                f"http://{PUBLIC}/redirect?to=http://127.0.0.1/cat.png"}]}]}),
    }
    server = running_server(cfg, engines=servable_vision_engines())
    srv = server.__enter__()

    def run(path: str, body: dict[str, Any]) -> Callable[[], None]:
        def check() -> None:
            r = httpx.post(srv.url + path, json={"model": "vl", **body}, timeout=30)
            assert r.status_code == 400, r.text
            if path == "/v1/messages":
                err = r.json()
                assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
                assert "media URLs must be public" in err["error"]["message"]
            else:
                err = r.json()["error"]
                assert err["code"] == "media_url_refused", err
                assert err["param"].endswith(".image_url"), err
            res = srv.ctx.manager.get("vl")
            assert (str(res.state), res.loads) == ("unloaded", 0)
        return check

    for name, (path, body) in bodies.items():
        results[name] = run(path, body)
    results["_stop_server"] = lambda: server.__exit__(None, None, None)
    return results


def main() -> int:
    wires = Tripwires()
    site = MediaSite(PUBLIC, 80)
    site.routes["/cat.png"] = (200, {"Content-Type": "image/png"}, png())
    results: dict[str, str] = {}
    for name, check in {**checks(site), **server_checks()}.items():
        before = len(wires.hits)
        try:
            check()
            results[name] = "ok"
        except Exception as e:  # reported per check
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        if len(wires.hits) > before:
            results[name] = f"connected to a forbidden address: {wires.hits[before:]}"
    results["tripwires_untouched"] = "ok" if not wires.hits else f"hits: {wires.hits}"
    site.close()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
