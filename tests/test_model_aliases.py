"""Registry aliases (issue 27): exact names and glob patterns such as ``claude-*``, so a
client with its own model names hard-coded (Claude Code, OpenAI's defaults) reaches a
model; a registered name wins over an exact alias, an exact alias over a pattern, and of
two matching patterns the most specific one (most literal characters; then file order);
an unmatched name stays a 404. Also ``mlxd ps`` at 80 columns, on the same server.

One server for the module: two tiny chat models and the starter Whisper entry (never
loaded; only its form errors are exercised).
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from rich.console import Console

from mlxd.cli import main
from mlxd.cli.admin import models_table
from mlxd.models.catalog import CatalogError, build_catalog
from mlxd.models.registry import RegistryError, parse_registry
from mlxd.models.spec import ModelEntry, alias_specificity
from mlxd.models.starter import STARTER_STT, starter_entries
from tests.helpers.retrieval import assert_openai_error, registry_config
from tests.helpers.server import RunningServer, running_server
from tests.helpers.workflow import mlxd

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- the registry file ----------------------------------------------------------------

def _registry(text: str) -> None:
    parse_registry(text, Path("models.yaml"))


@pytest.mark.parametrize("text, expected", [
    ("models:\n- {name: a, source: x, aliases: ['claude-*']}\n"
     "- {name: b, source: y, aliases: ['claude-*']}\n",
     "alias 'claude-*' is given to both 'a' and 'b'"),
    ("models:\n- {name: a, source: x, aliases: [b]}\n- {name: b, source: y}\n",
     "alias 'b' of model 'a' is the name of a model"),
    ("models:\n- {name: a, source: x, aliases: ['*']}\n",
     "would match every name"),
    ("models:\n- {name: a, source: x, aliases: [' spaced']}\n",
     "no surrounding spaces"),
])
def test_bad_aliases_are_refused_with_the_line(text: str, expected: str) -> None:
    with pytest.raises(RegistryError) as err:
        _registry(text)
    assert expected in str(err.value) and "models.yaml:" in str(err.value)
    assert "Value error" not in str(err.value)  # pydantic's prefix is not for people


def test_specificity_counts_literal_characters() -> None:
    assert alias_specificity("claude-3-5-haiku*") > alias_specificity("claude-*") > 0
    assert alias_specificity("gpt-[34]o?") == len("gpt-o")


# -- a server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model: Path, tiny_model_b: Path, tmp_path_factory: pytest.TempPathFactory,
           test_home: Path) -> Iterator[RunningServer]:
    entries = [ModelEntry(name="big", source=str(tiny_model), aliases=["claude-*", "tie-*"]),
               ModelEntry(name="small", source=str(tiny_model_b),
                          aliases=["claude-3-5-haiku*", "gpt-4o", "*-tie"]),
               STARTER_STT.model_copy()]
    cfg = registry_config(tmp_path_factory.mktemp("aliases") / "models.yaml", entries,
                          test_home)
    with running_server(cfg) as srv:
        yield srv


def _resolved(srv: RunningServer, name: str) -> str | int:
    r = httpx.get(f"{srv.url}/v1/models/{name}", timeout=30)
    return r.json()["id"] if r.status_code == 200 else r.status_code


@pytest.mark.parametrize("name, model", [
    ("big", "big"), ("small", "small"),
    ("claude-opus-4-1-20250805", "big"),  # Claude Code's main model
    ("claude-3-5-haiku-20241022", "small"),  # its background model: the longer pattern
    ("gpt-4o", "small"),  # an exact alias
    ("tie-x-tie", "big"),  # two patterns, 4 literal characters each: first in the file
    ("gpt-4o-mini", 404), ("claude", 404), ("CLAUDE-opus", 404),  # case-sensitive
])
def test_names_resolve_by_the_documented_rule(server: RunningServer, name: str,
                                              model: str | int) -> None:
    assert _resolved(server, name) == model


def test_an_unmatched_name_is_a_404_naming_the_models(server: RunningServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 404, "Available models: big, small, whisper-tiny-en", param="model")


def test_claude_code_names_reach_the_model_over_the_anthropic_api(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    reply = client.messages.create(model="claude-sonnet-4-5", max_tokens=3,
                                   messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.output_tokens >= 1
    assert server.ctx.manager.get("big").loads == 1


def test_model_cards_and_ready_line_list_the_aliases(server: RunningServer) -> None:
    from mlxd.cli.serve import _ready_line

    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
    assert cards["big"]["aliases"] == ["claude-*", "tie-*", "default"]
    assert cards["small"]["aliases"] == ["claude-3-5-haiku*", "gpt-4o", "*-tie"]
    line = _ready_line(server.ctx, "127.0.0.1", server.port)
    assert "alias claude-*, tie-*, default)" in line and "alias claude-3-5-haiku*, gpt-4o" in line


def test_put_of_an_alias_another_model_holds_is_a_409(server: RunningServer,
                                                      tiny_model: Path) -> None:
    r = httpx.put(server.url + "/v1/models", timeout=60, json={
        "name": "third", "source": str(tiny_model), "aliases": ["gpt-4o"]})
    assert_openai_error(r, 409, "Alias 'gpt-4o' already belongs to model 'small'")
    assert "third" not in server.ctx.manager.names


@pytest.mark.parametrize("entry, message", [
    ({"name": "gpt-4o"}, "'gpt-4o' is an alias of model 'small'"),
    ({"name": "third", "aliases": ["small"]}, "Alias 'small' is the name of a model"),
    ({"name": "big", "aliases": ["*-tie"]}, "Alias '*-tie' already belongs to model 'small'"),
])
def test_put_that_would_clash_changes_nothing(server: RunningServer, tiny_model: Path,
                                              entry: dict[str, object], message: str) -> None:
    """Refused before anything is replaced: "big" keeps serving under its own aliases."""
    r = httpx.put(server.url + "/v1/models", timeout=60,
                  json={"source": str(tiny_model), **entry})
    assert_openai_error(r, 409, message)
    assert sorted(server.ctx.manager.names) == ["big", "small", STARTER_STT.name]
    assert _resolved(server, "claude-opus-4") == "big"


def test_serve_alias_flags_name_the_served_model(tiny_model: Path, test_home: Path) -> None:
    """`mlxd serve MODEL --alias 'claude-*'`: all Claude Code needs, without a registry."""
    from mlxd.cli.serve import add_parser, config_from_args

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub, "serve", "")
    args = sub.choices["serve"].parse_args([str(tiny_model), "--alias", "claude-*",
                                            "--alias", "gpt-4o", "--no-starter",
                                            "--home", str(test_home)])
    config = config_from_args(args)
    assert config.aliases == ["claude-*", "gpt-4o"]
    with running_server(config) as srv:
        assert _resolved(srv, "claude-haiku-4-5") == tiny_model.name
        assert _resolved(srv, "gpt-4o") == tiny_model.name
        assert _resolved(srv, "gpt-4") == 404
    with pytest.raises(CatalogError, match="--alias: alias pattern '\\*' would match"):
        build_catalog(config.model_copy(update={"aliases": ["*"]}))


def test_register_takes_alias_flags(tiny_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = mlxd(home, "register", "agent", str(tiny_model), "--alias", "claude-*",
                  "--alias", "gpt-4o")
    assert result.rc == 0, result.stderr
    registry = parse_registry((home / "models.yaml").read_text(), home / "models.yaml")
    assert registry.models[0].aliases == ["claude-*", "gpt-4o"]


# -- section 6: misleading errors, on the same server --------------------------------------

def test_an_audio_part_to_a_text_model_points_to_transcription(server: RunningServer) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "big", "messages": [{"role": "user", "content": [part]}]})
    err = assert_openai_error(r, 400, "text model and cannot read audio")
    assert "/v1/audio/transcriptions" in err["message"] and "image" not in err["message"]


def test_an_anthropic_image_block_is_not_called_an_image_url_part(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="big", max_tokens=3, messages=[
            {"role": "user", "content": [block, {"type": "text", "text": "what is it?"}]}])
    message = err.value.body["error"]["message"]  # type: ignore[index]
    assert "cannot read images" in message and "image_url" not in message


def test_form_errors_do_not_leak_pydantics_prefix(server: RunningServer) -> None:
    r = httpx.post(server.url + "/v1/audio/transcriptions", timeout=30,
                   files={"file": ("a.wav", b"RIFF")},
                   data={"model": STARTER_STT.name, "response_format": "json",
                         "timestamp_granularities[]": "word"})
    err = assert_openai_error(r, 400, "timestamp_granularities needs response_format")
    assert "Value error" not in err["message"]


# -- section 6: `mlxd ps` fits 80 columns --------------------------------------------------

def _fits(out: str, width: int = 80) -> None:
    assert max(len(line) for line in out.splitlines()) <= width, out


def test_ps_fits_80_columns_when_piped(server: RunningServer, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # piped: rich's default width, 80
    assert main(["ps", "--url", server.url]) == 0
    out = capsys.readouterr().out
    _fits(out)
    for name in ("big", "small", STARTER_STT.name, "claude-3-5-haiku*", "text", "stt"):
        assert name in out, out
    assert main(["ps", "--url", server.url, "--json"]) == 0
    assert {m["id"] for m in json.loads(capsys.readouterr().out)} == {
        "big", "small", STARTER_STT.name}


def test_ps_keeps_starter_names_and_kinds_whole_at_80_columns() -> None:
    """The starter set, loaded and in use (the widest states), with its OpenAI aliases."""
    cards = [{"id": e.name, "kind": str(e.kind), "state": "loaded", "pinned": True,
              "in_use": 12, "memory_bytes": 3 * 2**30, "loads": 1,
              "last_used": "2026-12-04T21:00:00+00:00", "aliases": e.aliases}
             for e in starter_entries()]
    buf = io.StringIO()
    Console(file=buf, width=80).print(models_table(cards))
    out = buf.getvalue()
    _fits(out)
    for e in starter_entries():
        assert e.name in out and f" {e.kind} " in out
        assert all(a in out for a in e.aliases)
