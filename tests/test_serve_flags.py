"""``mlxd serve --help`` lists every setting: each ServerConfig field has a flag."""

from __future__ import annotations

import argparse

from mlxd.cli import build_parser
from mlxd.cli.serve import config_from_args
from mlxd.config import ServerConfig


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_config_field_has_a_serve_flag() -> None:
    parser = serve_parser()
    dests = {a.dest for a in parser._actions}
    missing = sorted(set(ServerConfig.model_fields) - dests)
    assert not missing, f"ServerConfig fields without a `mlxd serve` flag: {missing}"
    help_text = parser.format_help()
    for action in parser._actions:
        if action.dest in ServerConfig.model_fields and action.option_strings:
            assert action.option_strings[0] in help_text


def test_once_env_only_settings_parse_from_flags() -> None:
    args = serve_parser().parse_args([
        "--cors-origins", "http://a.test, http://b.test", "--max-n", "3",
        "--kv-reserve-tokens", "1024", "--response-store-max", "5",
        "--response-store-bytes", "4096", "--no-prefix-cache-persist",
        "--log-format", "json", "--log-repeat-interval", "2.5"])
    config = config_from_args(args)
    assert config.cors_origins == ["http://a.test", "http://b.test"]
    assert (config.max_n, config.kv_reserve_tokens) == (3, 1024)
    assert (config.response_store_max, config.response_store_bytes) == (5, 4096)
    assert config.enable_prefix_cache_persist is False
    assert config.log_format == "json" and config.log_repeat_interval == 2.5
    defaults = config_from_args(serve_parser().parse_args([]))
    assert defaults.enable_prefix_cache_persist is True and defaults.log_format == "text"
