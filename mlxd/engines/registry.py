"""Which engine serves each model kind, and whether this install can serve it.

Each kind maps to its engine class (an import path, imported on first use so
nothing above ``engines/`` pulls MLX in) and the optional extra whose packages
it needs (``pip install 'mlxd[vision]'``). Whether an extra is installed is
probed with ``importlib.util.find_spec``: no heavy import. The model manager
asks ``refusal(kind)`` before any load, so a model this install cannot serve
is a 400 naming its kind and the extra, and ``/v1/models`` says so.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from mlxd.errors import ModelLoadError
from mlxd.models.kinds import EXTRA_MODULES as EXTRA_MODULES  # re-exported
from mlxd.models.kinds import KINDS
from mlxd.models.spec import ModelKind

if TYPE_CHECKING:
    from mlxd.engines.base import ModelEngine
    from mlxd.runtime.worker import ModelWorker


class EngineClass(Protocol):
    """How every engine is constructed (``load`` then runs on the worker thread)."""

    def __call__(self, name: str, path: Path, worker: ModelWorker,
                 options: Any) -> ModelEngine: ...


@dataclass(frozen=True)
class EngineSpec:
    """How one kind is served."""

    engine: str | None  # "module:Class", imported on first use; None: no engine yet
    extra: str | None  # the optional extra it needs (None: the base install)
    # What the constructor's fourth argument is: "text" engines get TextEngineOptions
    # (generation limits), the others the ServerConfig.
    options: Literal["text", "server"] = "server"



# Each kind's engine, extra and options come from its KindSpec (models/kinds.py).
ENGINES: Mapping[ModelKind, EngineSpec] = MappingProxyType({
    kind: EngineSpec(spec.engine, spec.extra, spec.options) for kind, spec in KINDS.items()})

ModuleProbe = Callable[[str], bool]


def module_available(name: str) -> bool:
    """Whether top-level module ``name`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# What an extra cannot install itself: mlx-whisper declares torch, which it never
# imports, so it is installed without its declared deps (requirements/audio-no-deps.txt).
EXTRA_AFTER = MappingProxyType({"audio": "pip install --no-deps 'mlx-whisper>=0.4.3'"})


def install_hint(extra: str) -> str:
    after = EXTRA_AFTER.get(extra)
    return f"pip install 'mlxd[{extra}]'" + (f" then {after}" if after else "")


class EngineRegistry:
    """The kinds this install serves; one per app (its probe results are cached)."""

    def __init__(self, specs: Mapping[ModelKind, EngineSpec] = ENGINES,
                 probe: ModuleProbe | None = None) -> None:
        self.specs = specs
        self._probe = probe
        self._refusals: dict[ModelKind, str | None] = {}

    def refusal(self, kind: ModelKind) -> str | None:
        """Why ``kind`` cannot be served here, naming the extra; None when it can."""
        if kind not in self._refusals:
            self._refusals[kind] = self._why_not(kind)
        return self._refusals[kind]

    def _why_not(self, kind: ModelKind) -> str | None:
        spec = self.specs.get(kind)
        if spec is None or spec.engine is None:
            extra = f" (it will need the '{spec.extra}' extra)" if spec and spec.extra else ""
            return f"this version of mlxd has no engine for {kind} models yet{extra}."
        if spec.extra is None:
            return None
        probe = self._probe or module_available
        missing = [m for m in EXTRA_MODULES.get(spec.extra, ()) if not probe(m)]
        if missing:
            return (f"the '{spec.extra}' extra is not installed (missing {', '.join(missing)}); "
                    f"install it with {install_hint(spec.extra)}.")
        return None

    def servable_kinds(self) -> list[ModelKind]:
        return [k for k in ModelKind if self.refusal(k) is None]

    def engine_class(self, kind: ModelKind, model: str) -> EngineClass:
        """The engine class for ``kind``, imported now (on the model's worker thread).

        The manager refuses unservable kinds before a load; this is the backstop.
        """
        refusal = self.refusal(kind)
        spec = self.specs.get(kind)
        if refusal is not None or spec is None or spec.engine is None:
            raise ModelLoadError(model, f"it is of kind {kind}, which this server cannot "
                                        f"serve: {refusal}")
        module, _, name = spec.engine.partition(":")
        return cast(EngineClass, getattr(importlib.import_module(module), name))
