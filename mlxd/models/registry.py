"""The registry file: a YAML list of served models plus manager settings.

Validated at startup with errors that name the entry, the field and the line.
Every write is atomic (temp file + fsync + rename), so a crash mid-write
leaves the previous file intact, and every read-modify-write holds a lock file
(``.NAME-lock`` beside it) so concurrent writers in other processes (two
``mlxd model register`` at once, a server's ``PUT /v1/models``) lose nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlxd.errors import validation_text
from mlxd.jsonfile import atomic_write_text
from mlxd.models.spec import ModelEntry

try:
    import fcntl
except ImportError:  # Windows: no flock; see _exclusive_file
    fcntl = None  # type: ignore[assignment]

LOCK_TIMEOUT_S = 60.0


class RegistryError(ValueError):
    """The registry file is invalid; the message says where and why."""


class ManagerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_budget: str | int | None = None
    idle_unload_seconds: float | None = Field(None, ge=0)
    contention: Literal["wait", "fail"] | None = None
    wait_timeout_s: float | None = Field(None, ge=0)

    @field_validator("memory_budget")
    @classmethod
    def _budget(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            from mlxd.models.memory import parse_budget

            parse_budget(v, total=1 << 40)  # validate the syntax only
        return v


class RegistryData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    manager: ManagerSettings = Field(default_factory=ManagerSettings)
    models: list[ModelEntry] = Field(default_factory=list)


def _line_of(node: yaml.Node | None, path: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at ``path`` (keys and list indices)."""
    line = None
    for step in path:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == step), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int):
            node = node.value[step] if step < len(node.value) else None
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _describe(errors: list[Any], data: dict[str, Any], root: yaml.Node | None, path: Path) -> str:
    lines = []
    for err in errors:
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc)
        if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
            models = data.get("models") or []
            entry = models[loc[1]] if loc[1] < len(models) else {}
            name = entry.get("name") if isinstance(entry, dict) else None
            field_path = ".".join(str(p) for p in loc[2:]) or "(entry)"
            where = f"model '{name}' (entry {loc[1] + 1}), field '{field_path}'" if name else \
                f"models entry {loc[1] + 1}, field '{field_path}'"
        line = _line_of(root, loc)
        at = f"{path}:{line}" if line else str(path)
        lines.append(f"{at}: {where}: {validation_text(err)}")
    return "Invalid registry file:\n  " + "\n  ".join(lines)


def parse_registry(text: str, path: Path) -> RegistryData:
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise RegistryError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise RegistryError(f"{path}:1: the registry must be a mapping with 'models' (and 'manager')")
    try:
        registry = RegistryData.model_validate(data)
    except ValidationError as e:
        raise RegistryError(_describe(e.errors(), data, root, path)) from None
    seen: dict[str, int] = {}
    for i, entry in enumerate(registry.models):
        if entry.name in seen:
            line = _line_of(root, ("models", i))
            raise RegistryError(f"{path}:{line}: model name '{entry.name}' is defined twice "
                                f"(entries {seen[entry.name] + 1} and {i + 1})")
        seen[entry.name] = i
    _check_aliases(registry, root, path)
    return registry


def _check_aliases(registry: RegistryData, root: yaml.Node | None, path: Path) -> None:
    """An alias (exact or pattern) names one model; an exact alias is no model's name."""
    names = {entry.name for entry in registry.models}
    owner: dict[str, str] = {}
    for i, entry in enumerate(registry.models):
        for alias in entry.aliases:
            line = _line_of(root, ("models", i, "aliases"))
            if alias in names:
                raise RegistryError(f"{path}:{line}: alias '{alias}' of model '{entry.name}' "
                                    "is the name of a model")
            if alias in owner:
                raise RegistryError(f"{path}:{line}: alias '{alias}' is given to both "
                                    f"'{owner[alias]}' and '{entry.name}'")
            owner[alias] = entry.name


@contextmanager
def _exclusive_file(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Portable fallback lock: whoever creates ``path`` first holds it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            if time.monotonic() > deadline:
                raise RegistryError(f"{path} has been held for {timeout:.0f} s; if no mlxd "
                                    "process is writing the registry, delete it") from None
            time.sleep(0.02)
    try:
        yield
    finally:
        os.unlink(path)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        with _exclusive_file(path.with_name(path.name + ".excl")):
            yield
        return
    with open(path, "a+b") as fh:  # flock dies with the process: no stale locks
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class RegistryFile:
    """A registry YAML file on disk; reads validate, writes are atomic and serialized."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this process's and every other process's writers off the file."""
        with self._lock, file_lock(self.path.with_name(f".{self.path.name}-lock")):
            yield

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> RegistryData:
        if not self.path.exists():
            return RegistryData()
        return parse_registry(self.path.read_text(encoding="utf-8"), self.path)

    def save(self, data: RegistryData) -> None:
        doc: dict[str, Any] = {}
        manager = data.manager.model_dump(exclude_none=True)
        if manager:
            doc["manager"] = manager
        doc["models"] = [m.public() for m in data.models]
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
        parse_registry(text, self.path)  # never write a file we could not read back
        atomic_write_text(self.path, text)

    def upsert(self, entry: ModelEntry) -> bool:
        """Add or replace ``entry`` by name; returns True when it replaced one."""
        with self.locked():
            data = self.load()
            replaced = any(m.name == entry.name for m in data.models)
            data.models = [entry if m.name == entry.name else m for m in data.models]
            if not replaced:
                data.models.append(entry)
            self.save(data)
            return replaced

    def remove(self, name: str) -> bool:
        with self.locked():
            data = self.load()
            kept = [m for m in data.models if m.name != name]
            if len(kept) == len(data.models):
                return False
            data.models = kept
            self.save(data)
            return True
