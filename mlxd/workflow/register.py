"""``mlxd model register NAME SOURCE``: a registry entry plus ``registration.json``.

The artifact is checked first (it must be something the server can load, or a
GGUF it converts on first load), then ``registration.json`` is written next to
it (linking the conversion / acquisition manifests), then the registry file is
updated atomically. Nothing is written when a check fails, so bad input
changes nothing; a name already registered for another source is refused
unless ``--replace``. ``--url`` first pushes the entry to a running server
(``PUT /v1/models``, admin key); a refused push registers nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mlxd.errors import validation_text
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelEntry, ModelKind, ServingDefaults
from mlxd.sources.manifest import (
    finish_manifest,
    inventory,
    link_to,
    manifest_dir,
    manifest_path,
    new_manifest,
    write_manifest,
)
from mlxd.sources.refs import parse_source
from mlxd.workflow import WorkflowError


def find_entry(registry: RegistryFile, name: str) -> ModelEntry:
    """The registry entry called ``name`` (a clear error names the registry otherwise)."""
    data = registry.load()
    for entry in data.models:
        if entry.name == name:
            return entry
    known = ", ".join(m.name for m in data.models) or "none"
    raise WorkflowError(f"no model named '{name}' in {registry.path} (registered: {known}); "
                        "run `mlxd model register` first")


def _check_artifact(path: Path, kind: ModelKind | None) -> tuple[ModelKind, dict[str, Any]]:
    """The kind of a local artifact, refusing what the server cannot load."""
    from mlxd.workflow.inspect import inspect_path

    if ".partial-" in path.name or path.name.startswith("."):
        raise WorkflowError(f"{path} is an unfinished staging folder, not an artifact")
    report = inspect_path(path, hashes=False)
    if report.get("needs_conversion") and report.get("format") != "gguf":
        raise WorkflowError(f"{path} ({report.get('format')}) cannot be served as is: "
                            f"{report.get('conversion_note')}. Run `mlxd model convert` first.")
    if report.get("format") == "gguf" and report.get("converter") != "gguf":
        raise WorkflowError(f"{path}: {report.get('conversion_note')}")
    if report.get("format") == "gguf" and path.is_file() and path.suffix != ".gguf":
        raise WorkflowError(f"{path} is a GGUF file without the .gguf suffix (an Ollama blob?): "
                            "convert it, or acquire it with --join NAME.gguf, then register")
    found = kind or (ModelKind(report["kind"]) if report.get("kind") else None)
    if found is None:
        raise WorkflowError(f"cannot tell the kind of {path} ({report.get('kind_reason')}); "
                            "pass --kind")
    return found, report


def _upstream_links(path: Path) -> list[dict[str, Any]]:
    folder = path if path.is_dir() else path.parent
    links = []
    for step in ("conversion", "acquisition"):
        candidate = manifest_path(folder, step)
        if candidate.is_file():
            links.append(link_to(candidate))
    return links


def build_entry(name: str, source: str, *, kind: ModelKind | None,
                **fields: Any) -> ModelEntry:
    """A validated ``ModelEntry`` (pydantic errors become one clear message)."""
    defaults = {k: v for k, v in (fields.pop("defaults", None) or {}).items() if v is not None}
    try:
        return ModelEntry(name=name, source=source, kind=kind,
                          defaults=ServingDefaults(**defaults),
                          **{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {validation_text(err)}"
                             for err in e.errors())
        raise WorkflowError(f"invalid registry entry for '{name}': {problems}") from None


def _resolve(source: str, kind: ModelKind | None) -> tuple[str, ModelKind | None,
                                                           dict[str, Any] | None, Path | None]:
    ref = parse_source(source)
    if ref.path is None:
        return ref.spec, kind, None, None
    found, report = _check_artifact(ref.path, kind)
    return str(ref.path), found, report, ref.path


def register(name: str, source: str, *, registry: RegistryFile, home: Path,
             kind: ModelKind | None = None, replace: bool = False,
             url: str | None = None, api_key: str | None = None,
             command: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    """Add or update ``name`` in the registry; returns the registration manifest."""
    resolved, found_kind, report, path = _resolve(source, kind)
    entry = build_entry(name, resolved, kind=found_kind, **fields)
    existing = next((m for m in registry.load().models if m.name == name), None)
    if existing is not None and existing.source != entry.source and not replace:
        raise WorkflowError(f"name clash: '{name}' is already registered for {existing.source}; "
                            "pass --replace to point it at the new source, or choose another "
                            "name")
    if existing is not None and existing.source == entry.source and existing.qualification:
        entry = entry.model_copy(update={"qualification": existing.qualification})
    manifest = new_manifest("registration", command=command)
    manifest.update(name=name, registry=str(registry.path.resolve()), entry=entry.public(),
                    replaced=existing is not None)
    manifest["inputs"] = _upstream_links(path) if path is not None else []
    manifest["artifact"] = {"path": str(path) if path else entry.source,
                            "kind": str(entry.kind) if entry.kind else None,
                            "format": report.get("format") if report else None,
                            "files": [f.as_dict() for f in inventory(path)] if path else []}
    if url:  # first: a refused push (wrong key, bad entry) changes nothing here either
        manifest["pushed"] = push_entry(url, entry, api_key)
    finish_manifest(manifest, "complete")
    write_manifest(manifest_path(manifest_dir(entry, home), "registration"), manifest)
    registry.upsert(entry)
    return manifest


def push_entry(url: str, entry: ModelEntry, api_key: str | None) -> dict[str, Any]:
    """PUT the entry to a running server's admin API; returns what the server said."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.put(url.rstrip("/") + "/v1/models", json=entry.model_dump(mode="json",
                                                                            exclude_none=True),
                      headers=headers, timeout=60, trust_env=False)
    except httpx.HTTPError as e:
        raise WorkflowError(f"{url} cannot be reached ({e}); nothing was registered") from None
    if r.status_code != 200:
        raise WorkflowError(f"{url} refused the entry ({r.status_code}): {r.text[:300]}; "
                            "nothing was registered")
    card = r.json()
    return {"url": url, "state": card.get("state"), "persisted": card.get("persisted"),
            "replaced": card.get("replaced")}
