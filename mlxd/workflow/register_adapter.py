"""``mlxd model register NAME ADAPTER --base BASE``: an adapter served over its base.

An adapter is registered on its base model's registry entry (``adapters: {name:
folder}``), so it is served wherever the base is. Everything is checked first (the
base is registered, on this machine and a text model; the adapter fits it: layer
count, target module names, every shape, from the files' headers; the name is free),
so nothing is written when a check fails. A PEFT folder is converted to mlx-lm's
format on the way (``$MLXD_HOME/models/adapters/NAME`` with its ``conversion.json``).
``registration.json`` goes in the adapter's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.models.adapters import WEIGHTS_FILE, AdapterError
from mlxd.models.peft_adapters import PEFT_WEIGHTS
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.sources.manifest import (
    finish_manifest,
    inventory,
    link_to,
    manifest_path,
    new_manifest,
    write_manifest,
)
from mlxd.sources.refs import slug
from mlxd.sources.staging import OutputExists
from mlxd.workflow import WorkflowError
from mlxd.workflow.adapters import DORA_NOTE, adapter_format, describe_adapter
from mlxd.workflow.convert import plan_conversion, run_conversion
from mlxd.workflow.register import build_entry


def _named_base(data_models: list[ModelEntry], facts: dict[str, Any]) -> ModelEntry | None:
    named = facts.get("base")
    if not named:
        return None
    for entry in data_models:
        if entry.source == named or entry.name == named or (
                Path(entry.source).expanduser().absolute() ==
                Path(named).expanduser().absolute()):
            return entry
    return None


def _base_entry(models: list[ModelEntry], base: str | None, facts: dict[str, Any],
                registry: RegistryFile) -> ModelEntry:
    known = ", ".join(m.name for m in models) or "none"
    if base is None:
        found = _named_base(models, facts)
        if found is None:
            raise WorkflowError(f"which model is this adapter for? It names "
                                f"{facts.get('base') or 'no base model'}, which is not "
                                f"registered in {registry.path} (registered: {known}); pass "
                                "--base NAME")
        return found
    for entry in models:
        if entry.name == base:
            return entry
    raise WorkflowError(f"base model '{base}' is not registered in {registry.path} "
                        f"(registered: {known}); register it first: mlxd model register "
                        f"{base} PATH")


def _check_name(name: str, base: ModelEntry, models: list[ModelEntry], replace: bool) -> None:
    for entry in models:
        if entry.name == name or name in entry.aliases:
            raise WorkflowError(f"name clash: '{name}' is already a registered model name "
                                f"(of '{entry.name}'); choose another adapter name")
        if name in entry.adapters and not (entry.name == base.name and replace):
            raise WorkflowError(f"name clash: '{name}' is already an adapter of "
                                f"'{entry.name}'; pass --replace to re-point it, or choose "
                                "another name")


def _base_path(base: ModelEntry, home: Path) -> Path:
    from mlxd.models.catalog import CatalogError, local_path_of
    from mlxd.models.detection import DetectionError, detect

    try:
        path = local_path_of(base, home)
    except CatalogError as e:
        raise WorkflowError(str(e)) from None
    if path is None or not path.is_dir():
        raise WorkflowError(f"base model '{base.name}' ({base.source}) is not a model folder "
                            "on this machine; acquire or convert it first, so the adapter can "
                            "be checked against it")
    try:
        kind = base.kind or detect(path, name=base.name).kind
    except DetectionError as e:
        raise WorkflowError(f"base model '{base.name}': {e}") from None
    if kind != ModelKind.TEXT:
        raise WorkflowError(f"base model '{base.name}' is a {kind} model; adapters are served "
                            "over text models")
    return path


def register_adapter(name: str, source: str, *, base: str | None, registry: RegistryFile,
                     home: Path, replace: bool = False, out: Path | None = None,
                     command: list[str] | None = None) -> dict[str, Any]:
    """Register the adapter folder ``source`` as ``name`` over the registered ``base``;
    returns the registration manifest. Every check runs before anything is written."""
    path = Path(source).expanduser().absolute()
    fmt = adapter_format(path)
    if not path.exists():
        raise WorkflowError(f"{path}: no such adapter folder")
    if fmt is None:
        raise WorkflowError(f"{path} is not an adapter folder (adapter_config.json with "
                            f"{WEIGHTS_FILE} or {PEFT_WEIGHTS})")
    models = registry.load().models
    try:
        facts = describe_adapter(path)
    except AdapterError as e:
        raise WorkflowError(str(e)) from None
    if facts["fine_tune_type"] != "lora":
        raise WorkflowError(f"{path}: fine_tune_type {facts['fine_tune_type']!r}: "
                            + (DORA_NOTE if facts["fine_tune_type"] == "dora" else
                               "only LoRA adapters are served over a base"))
    base_entry = _base_entry(models, base, facts, registry)
    _check_name(name, base_entry, models, replace)
    base_path = _base_path(base_entry, home)
    build_entry(name, base_entry.source, kind=None)  # the adapter name is a valid model name
    fit = describe_adapter(path, base_path)["fit"]  # from headers, before anything is written
    if not fit.get("fits"):
        raise WorkflowError(fit.get("error") or f"{path} could not be checked against "
                            f"the base model '{base_entry.name}'")
    manifest = new_manifest("registration", command=command)
    inputs: list[dict[str, Any]] = []
    if fmt == "peft":
        target = Path(out).expanduser().absolute() if out else \
            home / "models" / "adapters" / slug(name)
        conversion = _convert(path, target, base_path, home, replace, command)
        inputs.append(link_to(manifest_path(target, "conversion")))
        manifest["conversion"] = conversion["outputs"]
        path = target
    else:
        acquired = manifest_path(path, "acquisition")
        inputs += [link_to(acquired)] if acquired.is_file() else []
    manifest.update(name=name, base=base_entry.name, registry=str(registry.path.resolve()),
                    adapter=describe_adapter(path, base_path), inputs=inputs,
                    artifact={"path": str(path), "kind": "adapter", "format": "mlx-lm",
                              "files": [f.as_dict() for f in inventory(path)]})
    finish_manifest(manifest, "complete")
    write_manifest(manifest_path(path, "registration"), manifest)
    with registry.locked():
        data = registry.load()
        current = next((m for m in data.models if m.name == base_entry.name), None)
        if current is None:
            raise WorkflowError(f"base model '{base_entry.name}' was removed meanwhile")
        updated = current.model_copy(update={"adapters": {**current.adapters,
                                                          name: str(path)}})
        data.models = [updated if m.name == current.name else m for m in data.models]
        registry.save(data)
    return manifest


def _convert(path: Path, target: Path, base: Path, home: Path, replace: bool,
             command: list[str] | None) -> dict[str, Any]:
    plan = plan_conversion(str(path), home=home, out=target, base=base)
    try:
        return run_conversion(plan, force=replace, command=command)
    except AdapterError as e:
        raise WorkflowError(str(e)) from None
    except OutputExists:  # staging names convert's flag; register's is --replace
        raise WorkflowError(f"{target} already exists (an earlier conversion of this adapter); "
                            "pass --replace to convert it again") from None
