"""``mlxd model show NAME``: the registry entry and its chain of manifests.

Starts from the entry's registration and qualification manifests and follows
each manifest's ``inputs`` links (conversion -> acquisition). With ``verify``
the linked manifests' sha256 and the artifact files' sha256 are checked again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.models.registry import RegistryFile
from mlxd.sources.manifest import (
    ManifestError,
    manifest_dir,
    manifest_path,
    read_manifest,
    sha256_of,
    verify_inventory,
)
from mlxd.workflow.register import find_entry

_FACTS = {
    "acquisition": lambda m: {"sources": [s.get("spec") for s in m.get("sources", [])],
                              "artifact": m.get("outputs", {}).get("artifact"),
                              "verified": [v.get("method") for v in m.get("verification", [])]},
    "conversion": lambda m: {"converter": m.get("recipe", {}).get("converter"),
                             "dtype": m.get("recipe", {}).get("dtype"),
                             "quantize": m.get("recipe", {}).get("quantize"),
                             "artifact": m.get("outputs", {}).get("artifact")},
    "registration": lambda m: {"registry": m.get("registry"),
                               "kind": m.get("artifact", {}).get("kind"),
                               "artifact": m.get("artifact", {}).get("path")},
    "qualification": lambda m: {"server": m.get("server"),
                                "failed": [k for k, v in m.get("checks", {}).items()
                                           if v.get("passed") is False],
                                "figures": m.get("figures")},
}


def summarize(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """One line of the chain: step, status, times, manifest path and key facts."""
    step = str(manifest.get("step") or manifest.get("schema", "?").split(".")[-1].split("/")[0])
    facts = _FACTS.get(step, lambda m: {})(manifest)
    return {"step": step, "schema": manifest.get("schema"), "status": manifest.get("status"),
            "started_at": manifest.get("started_at"), "finished_at": manifest.get("finished_at"),
            "seconds": manifest.get("seconds"), "manifest": str(path), "facts": facts}


def _walk(path: Path, seen: set[str], verify: bool, problems: list[str]) -> list[dict[str, Any]]:
    key = str(path.resolve())
    if key in seen or not path.is_file():
        return []
    seen.add(key)
    manifest = read_manifest(path)
    out = [summarize(path, manifest)]
    for link in manifest.get("inputs") or []:
        linked = Path(link["manifest"])
        if verify:
            if not linked.is_file():
                problems.append(f"{path.name} links {linked}, which is missing")
            elif sha256_of(linked) != link.get("sha256"):
                problems.append(f"{linked} changed since {path.name} linked it")
        out.extend(_walk(linked, seen, verify, problems))
    if verify:
        base = Path(manifest.get("outputs", {}).get("artifact") or
                    manifest.get("artifact", {}).get("path") or path.parent)
        base = base.parent if base.is_file() else base
        problems.extend(f"{path.name}: {p}" for p in
                        verify_inventory(base, manifest.get("files") or
                                         manifest.get("artifact", {}).get("files") or []))
    return out


def show_chain(name: str, *, registry: RegistryFile, home: Path,
               verify: bool = False) -> dict[str, Any]:
    """The entry, its manifests newest step first, and (with ``verify``) any problems.
    An adapter's manifests live in its folder; its entry is its base's."""
    from mlxd.workflow.adapters import find_adapter

    adapter = find_adapter(registry, name)
    entry = adapter[0] if adapter else find_entry(registry, name)
    mdir = adapter[1] if adapter else manifest_dir(entry, home)
    problems: list[str] = []
    chain: list[dict[str, Any]] = []
    seen: set[str] = set()
    for step in ("qualification", "registration"):
        try:
            chain.extend(_walk(manifest_path(mdir, step), seen, verify, problems))
        except ManifestError as e:
            problems.append(str(e))
    source = mdir if adapter else Path(entry.source)
    folder = source if source.is_dir() else None
    for step in ("conversion", "acquisition"):
        if folder is not None:
            chain.extend(_walk(manifest_path(folder, step), seen, verify, problems))
    order = {"qualification": 0, "registration": 1, "conversion": 2, "acquisition": 3}
    chain.sort(key=lambda c: order.get(c["step"], 9))
    return {"name": name, "entry": entry.public(),
            "adapter_of": entry.name if adapter else None, "registry": str(registry.path),
            "manifest_dir": str(mdir), "chain": chain, "verified": verify,
            "problems": problems}
