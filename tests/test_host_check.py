"""The Host header is checked: a guard against DNS rebinding (issue 31 item 12).

Without an API key a server answers only to loopback names (and the address it is
bound to) plus those given to ``--allowed-hosts``; ``*`` turns the check off, and
with an API key it is off unless the flag is given. A refused Host is a 400 in the
API's own error shape, before authentication and before any body is read.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.cli.serve import add_parser, config_from_args
from mlxd.config import ServerConfig
from tests.helpers.server import RunningServer, running_server


@pytest.fixture(scope="module")
def servers(test_home: Path) -> Iterator[dict[str, RunningServer]]:
    configs: dict[str, dict[str, Any]] = {
        "default": {}, "listed": {"allowed_hosts": ["models.lan", "10.0.0.7:8000"]},
        "any": {"allowed_hosts": ["*"]}, "key": {"api_key": "k"},
        "key_listed": {"api_key": "k", "allowed_hosts": ["models.lan"]}}
    started: dict[str, Any] = {}
    try:
        for name, extra in configs.items():
            cm = running_server(ServerConfig(home=test_home, no_starter=True, allow_no_models=True, **extra))
            started[name] = (cm, cm.__enter__())
        yield {name: srv for name, (_, srv) in started.items()}
    finally:
        for cm, _ in started.values():
            cm.__exit__(None, None, None)


def get(srv: RunningServer, host: str, path: str = "/v1/models",
        key: str | None = None) -> httpx.Response:
    headers = {"Host": host, **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.get(srv.url + path, headers=headers, timeout=30)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST.",
                                  "[::1]:{port}", "127.0.0.2", "localhost"])
def test_loopback_names_are_answered(servers: dict[str, RunningServer], host: str) -> None:
    srv = servers["default"]
    assert get(srv, host.format(port=srv.port)).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.0.0.7", "[2001:db8::1]:80"])
def test_other_names_are_a_400_without_an_api_key(servers: dict[str, RunningServer],
                                                  host: str) -> None:
    r = get(servers["default"], host)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "--allowed-hosts" in err["message"]


def test_the_refusal_comes_in_each_apis_shape_before_the_body_is_read(
        servers: dict[str, RunningServer]) -> None:
    srv = servers["default"]
    r = httpx.post(srv.url + "/v1/messages", headers={"Host": "evil.example"},
                   content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Host": "evil.example"},
                   content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]


def test_health_answers_any_host(servers: dict[str, RunningServer]) -> None:
    assert get(servers["default"], "10.1.2.3:8000", "/health").status_code == 200


def test_allowed_hosts_adds_names(servers: dict[str, RunningServer]) -> None:
    srv = servers["listed"]
    for host in ("models.lan", "MODELS.LAN:8000", "10.0.0.7", "localhost"):
        assert get(srv, host).status_code == 200, host
    assert get(srv, "evil.example").status_code == 400


def test_a_star_turns_the_check_off(servers: dict[str, RunningServer]) -> None:
    assert get(servers["any"], "evil.example").status_code == 200


def test_with_an_api_key_the_check_is_off_unless_the_flag_is_given(
        servers: dict[str, RunningServer]) -> None:
    assert get(servers["key"], "evil.example", key="k").status_code == 200
    assert get(servers["key_listed"], "evil.example", key="k").status_code == 400
    assert get(servers["key_listed"], "models.lan", key="k").status_code == 200


def test_the_flag_takes_a_comma_separated_list() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), "serve", "")
    args = parser.parse_args(["serve", "--allowed-hosts", "a.lan, b.lan:8000"])
    assert config_from_args(args).allowed_hosts == ["a.lan", "b.lan:8000"]
