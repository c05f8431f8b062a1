"""Registry entries: what a served model name points to and how it is served."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeGuard, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxd.config import check_kv_bits, check_kv_group_size


class ModelKind(str, Enum):
    TEXT = "text"
    VISION = "vision"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    STT = "stt"
    TTS = "tts"

    def __str__(self) -> str:
        return self.value


# Which kinds each endpoint family serves (endpoint model policies).
CHAT_KINDS = frozenset({ModelKind.TEXT, ModelKind.VISION})
EMBEDDING_KINDS = frozenset({ModelKind.EMBEDDING})
RERANK_KINDS = frozenset({ModelKind.RERANK})
STT_KINDS = frozenset({ModelKind.STT})
TTS_KINDS = frozenset({ModelKind.TTS})

E = TypeVar("E")


@dataclass(frozen=True)
class Family(Generic[E]):
    """What an endpoint asks the manager for: the model kinds it serves, typed by the
    engine protocol ``E`` those kinds implement (``engines/base.py`` defines them).

    ``manager.acquire(name, family)`` returns a ``ModelLease[E]``, so a route can call
    only its family's protocol. ``admits`` is the runtime check that makes it so: the
    lease hands out its engine only as an ``E`` (the kind check comes first, so it fails
    only for an engine that breaks its kind's protocol).
    """

    name: str
    kinds: frozenset[ModelKind]
    admits: Callable[[object], TypeGuard[E]]

    def narrow(self, engine: object) -> E:
        """``engine`` as this family's protocol; TypeError when it does not implement it."""
        if self.admits(engine):
            return engine
        raise TypeError(f"{type(engine).__name__} does not implement the {self.name} "
                        "engine protocol")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Parse ``8GB``, ``512MiB``, ``1.5g`` or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ValueError("size must be a number of bytes or a string such as '8GB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("size must not be negative")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"cannot parse size {value!r}: use bytes or e.g. '8GB', '512MiB'")
    unit = (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


class ServingDefaults(BaseModel):
    """Per-model defaults applied when a request leaves a field out."""

    model_config = ConfigDict(extra="forbid")

    # The same bounds as the request fields: every request to the model inherits these.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, gt=0)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_num_seqs: int | None = Field(None, gt=0)
    max_context: int | None = Field(None, gt=0)
    # quantized KV for this text model (--kv-bits / --kv-group-size when unset)
    kv_bits: int | None = None
    kv_group_size: int | None = None

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, v: int | None) -> int | None:
        return check_kv_bits(v)

    @field_validator("kv_group_size")
    @classmethod
    def _kv_group_size(cls, v: int | None) -> int | None:
        return check_kv_group_size(v)


_GLOB_CHARS = frozenset("*?[")


def is_alias_pattern(alias: str) -> bool:
    """Whether ``alias`` is a glob pattern (``*``, ``?``, ``[...]``, as ``fnmatch``)."""
    return any(c in _GLOB_CHARS for c in alias)


def alias_specificity(pattern: str) -> int:
    """How specific a glob pattern is: its count of literal characters outside ``[...]``.

    ``claude-3-5-haiku*`` (16) beats ``claude-*`` (7) for ``claude-3-5-haiku-latest``.
    """
    literal, in_class = 0, False
    for c in pattern:
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c not in "*?":
            literal += 1
    return literal


def validate_aliases(aliases: list[str]) -> list[str]:
    """``aliases`` if each is a usable name or pattern, else ``ValueError`` saying why."""
    for alias in aliases:
        if not alias or alias.strip() != alias or alias.startswith("/"):
            raise ValueError(f"alias {alias!r} must be non-empty, not start with '/' and "
                             "have no surrounding spaces")
        if is_alias_pattern(alias) and alias_specificity(alias) == 0:
            raise ValueError(f"alias pattern {alias!r} would match every name; give it "
                             "at least one literal character (e.g. 'claude-*')")
    if len(set(aliases)) != len(aliases):
        raise ValueError("an alias is listed twice")
    return aliases


class ModelEntry(BaseModel):
    """One served model name in the registry file."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    # Other names this model answers to: exact names or glob patterns ("claude-*",
    # "gpt-4o-mini-tts"). Resolution: a registered name, then an exact alias, then the
    # most specific matching pattern (see alias_specificity); file order breaks ties.
    aliases: list[str] = Field(default_factory=list, max_length=64)
    # Text-to-speech: other voice names (OpenAI's "alloy", ...) -> one of the model's voices.
    voice_aliases: dict[str, str] = Field(default_factory=dict, max_length=256)
    revision: str | None = None
    kind: ModelKind | None = None
    pinned: bool = False
    ttl_seconds: float | None = Field(None, ge=0)
    preload: bool = False
    estimated_memory: int | None = None
    defaults: ServingDefaults = Field(default_factory=ServingDefaults)
    trust_remote_code: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    draft_model: str | None = None  # a text model's draft model (source), --draft-model
    # LoRA adapters served over this text model: served name -> mlx-lm adapter folder
    adapters: dict[str, str] = Field(default_factory=dict)
    sha256: str | None = None
    qualification: dict[str, Any] | None = None
    description: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v.strip() != v or ("/" in v and v.startswith("/")):
            raise ValueError("name must not start with '/' or have surrounding spaces")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        return validate_aliases(v)

    @field_validator("voice_aliases")
    @classmethod
    def _voice_aliases(cls, v: dict[str, str]) -> dict[str, str]:
        for alias, voice in v.items():
            if not alias.strip() or not voice.strip():
                raise ValueError("voice_aliases maps a non-empty voice name to a voice")
        return v

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: dict[str, str]) -> dict[str, str]:
        for name, folder in v.items():
            if not name or not folder.strip():
                raise ValueError("each adapter needs a name and a folder")
            cls._name(name)
        return v

    @field_validator("estimated_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    def public(self) -> dict[str, Any]:
        """The entry as written to the registry file (no empty fields)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        data["name"], data["source"] = self.name, self.source
        return data
