"""One home per model kind (``models/kinds.py``): detection, the engine registry and the
memory budget read the same ``KindSpec``, and what detection accepts for a kind is what
its engine loads."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.engines import base
from mlxd.engines.encoders.cross_encoder import SUPPORTED_MODEL_TYPES
from mlxd.engines.registry import ENGINES
from mlxd.models.detection import DetectionError, detect
from mlxd.models.kinds import KINDS
from mlxd.models.memory import MIN_ACTIVATION_RESERVE, estimate_memory
from mlxd.models.spec import ModelKind


def _cross_encoder(folder: Path, model_type: str, arch: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": model_type, "architectures": [arch], "num_labels": 1}))
    return folder


def test_every_kind_has_one_spec_and_the_engine_registry_is_built_from_it() -> None:
    assert set(KINDS) == set(ModelKind)
    for kind, spec in KINDS.items():
        assert spec.kind == kind
        assert (ENGINES[kind].engine, ENGINES[kind].extra, ENGINES[kind].options) == (
            spec.engine, spec.extra, spec.options)


@pytest.mark.parametrize("kind", list(ModelKind))
def test_a_kinds_engine_path_names_a_class_and_its_protocol_exists(kind: ModelKind) -> None:
    spec = KINDS[kind]
    assert spec.engine is not None
    module, _, name = spec.engine.partition(":")
    assert isinstance(getattr(importlib.import_module(module), name), type)
    assert isinstance(getattr(base, spec.protocol), type)


@pytest.mark.parametrize("kind", list(ModelKind))
def test_a_kinds_engine_class_passes_its_familys_lease_check(kind: ModelKind) -> None:
    """A lease hands out its engine only as the family's protocol (``Family.narrow``, a
    runtime check): every kind's engine class must pass it, or each lease would fail."""
    spec = KINDS[kind]
    assert spec.engine is not None
    module, _, name = spec.engine.partition(":")
    engine_class = getattr(importlib.import_module(module), name)
    assert issubclass(engine_class, getattr(base, spec.protocol))
    assert issubclass(engine_class, base.ModelEngine)


def test_the_rerank_types_detection_accepts_are_the_ones_the_cross_encoder_loads() -> None:
    assert KINDS[ModelKind.RERANK].model_types == frozenset(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_a_loadable_cross_encoder_is_detected_as_rerank(model_type: str, tmp_path: Path) -> None:
    folder = _cross_encoder(tmp_path / "m", model_type, "XForSequenceClassification")
    assert detect(folder).kind == ModelKind.RERANK


@pytest.mark.parametrize("model_type", ["modernbert", "electra", "deberta", "deberta-v2",
                                        "distilbert"])
def test_a_cross_encoder_the_engine_cannot_load_is_refused_at_detection(
        model_type: str, tmp_path: Path) -> None:
    """Not a rerank model that fails at load time: a clear error naming what loads."""
    folder = _cross_encoder(tmp_path / "m", model_type, "XForSequenceClassification")
    with pytest.raises(DetectionError) as e:
        detect(folder, name="ranker")
    assert f"a {model_type} cross-encoder" in str(e.value)
    assert "bert, camembert, roberta" in str(e.value)


def test_the_budget_reads_the_kinds_reserve() -> None:
    weights = 1 << 30
    for kind in (ModelKind.TTS, ModelKind.STT, ModelKind.EMBEDDING):
        reserve = estimate_memory(kind, weights).total - weights
        assert reserve == max(MIN_ACTIVATION_RESERVE,
                              int(weights * KINDS[kind].activation_reserve))


def test_the_kind_table_is_readable_without_importing_mlx() -> None:
    code = ("import sys, mlxd.models.kinds, mlxd.models.detection; "
            "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_'))]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
