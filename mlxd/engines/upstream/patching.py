"""Narrow, reversible fixes to an upstream library, applied only while a model of their
family is loaded: the machinery the vision (mlx-vlm) and audio (mlx-audio) patches share.

Each patch declares the families it is for, the versions of the libraries it was
checked against, a ``self_check`` that proves on the installed versions that the
upstream code still needs it and that the patched code is right, and the (owner,
attribute) pairs it replaces. ``PatchRegistry.activate(model_type)`` applies every
patch of that family (reference counted, so two loaded models share one
application) and returns a handle whose ``undo`` restores the upstream attributes,
the very objects that were there, when the last model of the family unloads.

On a version a patch was not checked against, its self-check runs: if it passes the
patch is applied with a warning, if it fails the model is refused with a clear error
(never a silent wrong answer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.engines.upstream.versions import installed
from mlxd.errors import ModelLoadError

log = logging.getLogger(__name__)
_ABSENT = object()  # an attribute the owner only inherited before the patch


@dataclass(frozen=True)
class Patch:
    """One upstream fix: where it goes and when it applies."""

    name: str
    families: frozenset[str]
    checked: dict[str, tuple[str, ...]]  # distribution -> versions it was checked against
    # (owner, attribute, replacement) for the loaded (model, processor)
    targets: Callable[[Any, Any], list[tuple[Any, str, Any]]]
    self_check: Callable[[Any, Any], bool]  # True: still needed and the replacement behaves
    why: str = ""


@dataclass
class _Applied:
    count: int
    originals: list[tuple[Any, str, Any]] = field(default_factory=list)


class PatchHandle:
    """What one loaded model holds; ``undo`` releases its share (idempotent)."""

    def __init__(self, registry: PatchRegistry, names: list[str]) -> None:
        self._registry = registry
        self.names = names
        self._done = False

    def undo(self) -> None:
        if not self._done:
            self._done = True
            self._registry.release(self.names)


class PatchRegistry:
    """The patches this process can apply, and which are applied now."""

    def __init__(self, patches: list[Patch], version: Callable[[str], str | None] = installed
                 ) -> None:
        self.patches = {p.name: p for p in patches}
        self._version = version
        self._lock = threading.Lock()
        self._applied: dict[str, _Applied] = {}

    def for_family(self, model_type: str) -> list[Patch]:
        return [p for p in self.patches.values() if model_type in p.families]

    def active(self) -> list[str]:
        with self._lock:
            return sorted(self._applied)

    def activate(self, model_type: str, model: str, loaded: tuple[Any, Any]) -> PatchHandle:
        """Apply the family's patches (checking versions first) for one loaded model;
        ``loaded`` is its (mlx-vlm model, processor)."""
        names: list[str] = []
        try:
            for patch in self.for_family(model_type):
                self._acquire(patch, model, loaded)
                names.append(patch.name)
        except Exception:
            self.release(names)
            raise
        return PatchHandle(self, names)

    def _acquire(self, patch: Patch, model: str, loaded: tuple[Any, Any]) -> None:
        with self._lock:
            held = self._applied.get(patch.name)
            if held is not None:
                held.count += 1
                return
            unknown = [f"{d} {self._version(d)}" for d, ok in patch.checked.items()
                       if self._version(d) not in ok]
            if unknown:
                log.warning("patch %s was checked against %s, not %s: running its self-check",
                            patch.name, patch.checked, ", ".join(unknown))
                if not patch.self_check(*loaded):
                    raise ModelLoadError(model, (
                        f"the '{patch.name}' fix for {sorted(patch.families)} models does not "
                        f"hold on {', '.join(unknown)} (checked against {patch.checked}); "
                        "refusing the model rather than risk wrong answers."))
            originals = []
            for owner, attr, replacement in patch.targets(*loaded):
                originals.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
                setattr(owner, attr, replacement)
            self._applied[patch.name] = _Applied(1, originals)
            log.info("patch %s applied (%s)", patch.name, patch.why)

    def release(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                held = self._applied.get(name)
                if held is None:
                    continue
                held.count -= 1
                if held.count == 0:
                    for owner, attr, original in reversed(held.originals):
                        if original is _ABSENT:  # the patch shadowed an inherited attribute
                            delattr(owner, attr)
                        else:
                            setattr(owner, attr, original)
                    del self._applied[name]
                    log.info("patch %s undone", name)


class ProcessRegistry:
    """The process's one ``PatchRegistry`` of a kind, built on first use; call it to get it.

    Patches change class attributes, which are process-wide: the one record of what is
    applied must be process-wide too (the exception to "no module-level state").
    """

    def __init__(self, patches: Callable[[], list[Patch]]) -> None:
        self._patches = patches
        self._lock = threading.Lock()
        self._registry: PatchRegistry | None = None

    def __call__(self) -> PatchRegistry:
        with self._lock:
            if self._registry is None:
                self._registry = PatchRegistry(self._patches())
            return self._registry
