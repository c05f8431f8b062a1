"""What an upstream adapter declares, and the check that holds it to the installed library.

An adapter (``upstream/mlx_lm.py``, ``upstream/mlx_vlm.py``) lists every private name of
its library that mlxd uses (``Private``) and the versions it was checked against. On one
of those versions a model loads as before. On another, the adapter's self-check walks
every private name: when all are still there, with the expected shape, the model loads
with a warning; when one is gone, the model is refused with a message that names the
installed and the checked versions, instead of a request misbehaving later.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from mlxd.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Private:
    """One private name of an upstream library that mlxd relies on.

    ``kind``: ``attribute`` is assigned as ``self.<name>`` in the owner class (or a
    base); ``method`` is a callable on the class, with ``params`` its parameter names
    after ``self`` when they matter; ``key`` is a string the module's code reads (a
    private keyword argument); ``global`` is a global name the module's function
    ``owner`` reads, which mlxd replaces in a copy of its globals.
    """

    module: str
    owner: str  # a class in ``module`` (dotted when nested), a function for a global; "" for a key
    name: str
    kind: Literal["attribute", "method", "key", "global"]
    used_by: str  # the mlxd module that needs it, and why
    params: tuple[str, ...] | None = None


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _sources(cls: type) -> str:
    parts = []
    for base in cls.__mro__:
        if base is object:
            continue
        try:
            parts.append(inspect.getsource(base))
        except (OSError, TypeError):
            continue
    return "\n".join(parts)


def problem(p: Private) -> str | None:
    """What is wrong with ``p`` on the installed library; None when it holds."""
    try:
        module = importlib.import_module(p.module)
    except ImportError as e:
        return f"{p.module} does not import ({e})"
    if p.kind == "key":
        return None if f'"{p.name}"' in inspect.getsource(module) else (
            f"{p.module} no longer reads the key {p.name!r}")
    if p.kind == "global":
        func = getattr(module, p.owner, None)
        code = getattr(func, "__code__", None)
        if code is None:
            return f"{p.module}.{p.owner} is not a function"
        return None if p.name in code.co_names else (
            f"{p.module}.{p.owner} no longer reads the global {p.name!r}")
    owner: object = module
    for part in p.owner.split("."):  # a nested class: "LRUPromptCache.CacheOrder"
        owner = getattr(owner, part, None)
    if not isinstance(owner, type):
        return f"{p.module}.{p.owner} is not a class"
    where = f"{p.module}.{p.owner}.{p.name}"
    if p.kind == "attribute":
        assigned = re.compile(rf"self\.{re.escape(p.name)}\s*(?::[^=\n]+)?=(?!=)")
        return None if assigned.search(_sources(owner)) else f"{where} is no longer assigned"
    try:
        member = inspect.getattr_static(owner, p.name)
    except AttributeError:
        return f"{where} is gone"
    func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    if not callable(func):
        return f"{where} is not a method"
    if p.params is not None:
        names = tuple(inspect.signature(func).parameters)[1:]
        if names[:len(p.params)] != p.params:
            return f"{where} takes {names}, not {p.params}"
    return None


def problems(private: Sequence[Private]) -> list[str]:
    """Every private name that does not hold on the installed library."""
    return [found for p in private if (found := problem(p)) is not None]


@dataclass(frozen=True)
class Adapter:
    """One upstream library's declaration: its distribution, the versions its private
    names were checked against, and those names."""

    distribution: str
    checked: tuple[str, ...]
    private: tuple[Private, ...]

    def require(self, model: str, version: Callable[[str], str | None] = installed) -> None:
        """Let ``model`` load on the installed version, or refuse it (``ModelLoadError``
        naming the versions) when a private name it needs is gone."""
        have = version(self.distribution)
        if have in self.checked:
            return
        found = problems(self.private)
        if found:
            raise ModelLoadError(model, (
                f"{self.distribution} {have} is not a version mlxd was checked against "
                f"({', '.join(self.checked)}), and its internals mlxd relies on changed: "
                f"{'; '.join(found)}. Install {self.distribution}=={self.checked[-1]}."))
        log.warning("%s %s was not checked with mlxd (checked: %s); its self-check passed",
                    self.distribution, have, ", ".join(self.checked))
