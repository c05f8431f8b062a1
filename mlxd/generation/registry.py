"""Parsers registered by name (vLLM's ``ToolParserManager`` / ``ReasoningParserManager``).

A registry is filled while its modules are imported (decorators and ``add``
calls at module level) and only read afterwards. A registry may extend others:
``engines/text/tool_parsers.py`` adds the mlx-lm-backed tool parsers on top of the
backend-free ones here, so ``generation/`` never imports mlx-lm.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class NamedRegistry(Mapping[str, T]):
    """Items by their ``name``, after those of the registries it extends."""

    def __init__(self, what: str, *extends: NamedRegistry[T]) -> None:
        self.what = what  # "tool-call parser": used in the unknown-name error
        self._extends = extends
        self._items: dict[str, T] = {}

    def add(self, item: T) -> T:
        """Register ``item`` under its name (import time only; names are unique)."""
        if item.name in self:
            raise ValueError(f"{self.what} '{item.name}' is registered twice")
        self._items[item.name] = item
        return item

    def named(self, name: str) -> T:
        """The item called ``name``; ``ValueError`` listing the known names otherwise."""
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"Unknown {self.what} '{name}'. Known: {', '.join(self)}") from None

    def __getitem__(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        for base in self._extends:
            if name in base:
                return base[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for names in (*self._extends, self._items):
            for name in names:
                if name not in seen:
                    seen.add(name)
                    yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)
