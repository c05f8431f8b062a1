"""LoRA adapters in the model workflow: what an adapter folder is (``mlxd model inspect``),
whether it fits a base model, and its conversion from PEFT to mlx-lm's format.

Registering one over a base is ``mlxd.workflow.register_adapter``; fusing one into its
base is ``mlxd model convert BASE --fuse --adapter PATH`` (``mlxd.workflow.convert``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.models.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    adapter_config,
    base_layer_count,
    read_adapter,
    safetensors_shapes,
)
from mlxd.models.peft_adapters import PEFT_WEIGHTS, is_peft_adapter, read_peft, write_mlx_adapter
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelEntry
from mlxd.workflow import WorkflowError

DORA_NOTE = ("DoRA adapters are not served over a base (mlxd batches plain LoRA per row); "
             "fuse it into a model with `mlxd model convert BASE --fuse --adapter PATH`")


def adapter_format(path: Path) -> str | None:
    """``"mlx-lm"`` or ``"peft"`` for an adapter folder, else None."""
    if not path.is_dir() or not (path / CONFIG_FILE).is_file():
        return None
    if (path / WEIGHTS_FILE).is_file():
        return "mlx-lm"
    return "peft" if is_peft_adapter(path) else None


def _mlx_facts(folder: Path) -> dict[str, Any]:
    """What an mlx-lm adapter folder says of itself (a DoRA one too: it is fused, not served)."""
    config = adapter_config(folder)
    kind = config.get("fine_tune_type", "lora")
    found = config.get("lora_parameters")
    params: dict[str, Any] = found if isinstance(found, dict) else {}
    names = safetensors_shapes(folder / WEIGHTS_FILE)
    paths = {n.rsplit(".", 1)[0] for n in names}
    keys = sorted({p.split(".layers.", 1)[1].split(".", 1)[1] for p in paths
                   if ".layers." in p and "." in p.split(".layers.", 1)[1]})
    return {"format": "mlx-lm", "fine_tune_type": kind, "rank": params.get("rank"),
            "scale": params.get("scale"), "num_layers": config.get("num_layers"),
            "targets": params.get("keys") or keys, "adapted_layers": len(paths),
            "base": config.get("model") if isinstance(config.get("model"), str) else None}


def describe_adapter(path: Path, base: Path | None = None) -> dict[str, Any]:
    """An adapter's facts, and whether it fits ``base`` (else the base it names, when
    that is a model folder on this machine). Raises ``AdapterError`` for a broken one."""
    fmt = adapter_format(path)
    if fmt == "peft":
        peft = read_peft(path)
        facts = peft.facts()
    elif fmt == "mlx-lm":
        facts = _mlx_facts(path)
    else:
        raise AdapterError(f"{path} is not an adapter folder (adapter_config.json with "
                           f"{WEIGHTS_FILE} or {PEFT_WEIGHTS}).")
    named = Path(facts["base"]).expanduser() if facts.get("base") else None
    against = base or (named if named is not None and (named / "config.json").is_file()
                       else None)
    fit: dict[str, Any] = {"base": str(against) if against else None, "checked": False}
    if against is not None:
        try:
            if fmt == "peft":
                _check_peft_fits(read_peft(path), against)
            elif facts["fine_tune_type"] == "lora":
                read_adapter(path, against)
            fit.update(checked=True, fits=True)
        except AdapterError as e:
            fit.update(checked=True, fits=False, error=str(e))
    facts["fit"] = fit
    if facts["fine_tune_type"] == "dora":
        facts["note"] = DORA_NOTE
    elif fmt == "peft":
        facts["note"] = "PEFT format: converted to mlx-lm's on `mlxd model register` (or " \
                        "`mlxd model convert`)"
    return facts


def _check_peft_fits(peft: Any, base: Path) -> None:
    """A PEFT adapter against a base folder, from headers: layers and every shape."""
    from mlxd.models.adapters import AdapterTarget, check_fits

    layers = base_layer_count(base)
    targets = [AdapterTarget(p, i, o) for p, (i, o) in peft.shapes.items()]
    num = peft.num_layers(layers)
    if num < 1:
        raise AdapterError(f"{peft.folder} adapts layer {max(peft.layers)}; the base model "
                           f"{base.name} has {layers}: the adapter was trained for another "
                           "model.")
    check_fits(targets, num, base, peft.folder)


def inspect_adapter(path: Path) -> dict[str, Any]:
    """The ``mlxd model inspect`` report of an adapter folder."""
    try:
        facts = describe_adapter(path)
    except AdapterError as e:
        raise WorkflowError(str(e)) from None
    served = facts["format"] == "mlx-lm" and facts["fine_tune_type"] == "lora"
    return {"format": f"{facts['format']}-adapter", "adapter": facts,
            "architecture": None, "model_type": None,
            "mlx_format": facts["format"] == "mlx-lm", "loadable_as_is": served,
            "needs_conversion": facts["format"] == "peft",
            "converter": "peft-lora" if facts["format"] == "peft" else None,
            "conversion_note": facts.get("note") or "mlx-lm LoRA adapter: served over its "
            "base (`mlxd model register NAME PATH --base BASE`)"}


# -- PEFT -> mlx-lm ---------------------------------------------------------------------

def convert_peft_into(folder: Path, staging: Path, base: Path | None) -> dict[str, Any]:
    """Write the PEFT adapter ``folder`` into ``staging`` in mlx-lm's format, checked
    against ``base`` (or the base it names, when that folder is here)."""
    peft = read_peft(folder)
    if base is None and peft.base and (Path(peft.base).expanduser() / "config.json").is_file():
        base = Path(peft.base).expanduser()
    layers = base_layer_count(base) if base is not None else None
    details = write_mlx_adapter(peft, staging, base_layers=layers)
    read_adapter(staging, base)  # the written folder, as the server will read it
    return {**details, "checked_against": str(base) if base else None}


def fit_base(report: dict[str, Any], base: str, registry: RegistryFile,
             home: Path) -> dict[str, Any]:
    """``mlxd model inspect ADAPTER --base BASE``: the adapter checked against BASE (a
    registered model name or a model folder); a mismatch is an error naming it."""
    from mlxd.models.catalog import CatalogError, local_path_of

    if "adapter" not in report:
        raise WorkflowError(f"--base is for adapter folders; {report.get('path')} is a model")
    folder = Path(base).expanduser()
    if not (folder / "config.json").is_file():
        entry = next((m for m in registry.load().models if m.name == base), None)
        if entry is None:
            raise WorkflowError(f"--base {base}: neither a model folder nor a model registered "
                                f"in {registry.path}")
        try:
            found = local_path_of(entry, home)
        except CatalogError as e:
            raise WorkflowError(str(e)) from None
        if found is None or not (found / "config.json").is_file():
            raise WorkflowError(f"--base {base}: its files ({entry.source}) are not a model "
                                "folder on this machine")
        folder = found
    try:
        fit = describe_adapter(Path(report["path"]), folder)["fit"]
    except AdapterError as e:
        raise WorkflowError(str(e)) from None
    if fit.get("fits") is False:
        raise WorkflowError(str(fit["error"]))
    report["adapter"]["fit"] = fit
    return report


def find_adapter(registry: RegistryFile, name: str) -> tuple[ModelEntry, Path] | None:
    """The base entry serving adapter ``name`` and the adapter's folder, if registered."""
    for entry in registry.load().models:
        if name in entry.adapters:
            return entry, Path(entry.adapters[name])
    return None
