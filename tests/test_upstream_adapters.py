"""The upstream adapters (``engines/upstream/``): every private name of mlx-lm, mlx-vlm,
mlx-embeddings and mlx-whisper that mlxd uses is declared in its library's adapter and
holds on the installed version, and the private attributes are read from outside the
library's own classes nowhere else."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from mlxd.engines.upstream import mlx_audio, mlx_embeddings, mlx_lm, mlx_vlm, mlx_whisper
from mlxd.engines.upstream.versions import Adapter, Private, installed, problem
from mlxd.errors import ModelLoadError

ADAPTERS = {"mlx-lm": mlx_lm.ADAPTER, "mlx-vlm": mlx_vlm.ADAPTER,
            "mlx-embeddings": mlx_embeddings.ADAPTER, "mlx-whisper": mlx_whisper.ADAPTER,
            "mlx-audio": mlx_audio.ADAPTER}
ENGINES = Path(__file__).resolve().parent.parent / "mlxd" / "engines"
NAMES = [pytest.param(p, id=f"{dist}:{p.owner or p.module}.{p.name}")
         for dist, adapter in ADAPTERS.items() for p in adapter.private]


@pytest.mark.parametrize("private", NAMES)
def test_every_private_name_holds_on_the_installed_version(private: Private) -> None:
    assert problem(private) is None


@pytest.mark.parametrize("dist", sorted(ADAPTERS))
def test_the_installed_version_is_one_the_adapter_was_checked_against(dist: str) -> None:
    """An upgrade fails here first: check the adapter's names (the test above), then add
    the version to its ``checked``."""
    assert installed(dist) in ADAPTERS[dist].checked


def test_a_checked_version_loads_without_a_self_check() -> None:
    broken = Adapter("mlx-lm", ("0.32.2",), (
        Private("mlx_lm.generate", "BatchGenerator", "_no_such_name", "attribute", "test"),))
    broken.require("m", version=lambda _: "0.32.2")  # the checked version: no walk


def test_another_version_with_its_internals_intact_loads_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mlxd.engines.upstream.versions"):
        mlx_lm.ADAPTER.require("m", version=lambda _: "0.99.0")
    assert "mlx-lm 0.99.0 was not checked" in caplog.text
    assert "0.32.2" in caplog.text


def test_another_version_without_a_name_refuses_the_model_naming_the_versions() -> None:
    gone = Private("mlx_lm.generate", "BatchGenerator", "_no_such_name", "attribute", "test")
    adapter = Adapter("mlx-lm", ("0.32.2",), (*mlx_lm.PRIVATE, gone))
    with pytest.raises(ModelLoadError) as e:
        adapter.require("m", version=lambda _: "0.99.0")
    message = str(e.value)
    assert "mlx-lm 0.99.0" in message and "0.32.2" in message
    assert "mlx_lm.generate.BatchGenerator._no_such_name is no longer assigned" in message


def test_the_self_check_sees_a_changed_shape() -> None:
    """A method whose parameters changed, a class that moved, a key no longer read."""
    assert "takes" in (problem(Private("mlx_vlm.generate.ar", "BatchGenerator",
                                       "_extend_generation_batch", "method", "t",
                                       ("batch", "extra"))) or "")
    assert "is not a class" in (problem(Private("mlx_lm.generate", "NoSuchClass", "_x",
                                                "attribute", "t")) or "")
    assert "no longer reads" in (problem(Private("mlx_vlm.generate.ar", "", "_no_such_key",
                                                 "key", "t")) or "")
    assert "is gone" in (problem(Private("mlx_lm.generate", "BatchGenerator", "_no_method",
                                         "method", "t")) or "")
    assert "no longer reads the global" in (problem(Private(
        "mlx_whisper.transcribe", "transcribe", "NoSuchHolder", "global", "t")) or "")


def test_only_the_adapters_read_upstream_private_names_from_outside() -> None:
    """``obj._name`` or ``getattr(obj, "_name")`` for a declared name appears only in
    ``engines/upstream/``; subclasses use their inherited names as ``self._name`` and
    ``super()._name``."""
    names = {p.name for a in ADAPTERS.values() for p in a.private
             if p.kind in ("attribute", "method") and p.name.startswith("_")}
    alternatives = "|".join(sorted(names))
    pattern = re.compile(rf"(?<!self)(?<!super\(\))\.({alternatives})\b|\"({alternatives})\"")
    offenders = []
    for path in ENGINES.rglob("*.py"):
        if path.parent.name == "upstream":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(ENGINES)}:{n}: {line.strip()}")
    assert offenders == []
