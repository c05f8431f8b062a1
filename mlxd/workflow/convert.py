"""``mlxd model convert SOURCE``: to MLX format, with the recipe in ``conversion.json``.

Converters: GGUF (llama, qwen2, qwen3, gemma3) -> MLX through our dequantiser
(``gguf_convert``); Hugging Face safetensors -> MLX through mlx-lm (text) or
mlx-vlm (vision) with dtype and quantisation; CTranslate2 Whisper ->
mlx-whisper (``ct2_whisper``). A GGUF conversion to bfloat16 or with
``--quantize`` runs in two stages: GGUF -> float32 MLX, then mlx-lm. The output
is built in a staging folder and moved into place in one rename, with its
manifest inside, so a killed conversion leaves nothing under the final name.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxd.sources.manifest import (
    ProgressFn,
    finish_manifest,
    inventory,
    link_to,
    manifest_path,
    new_manifest,
    write_manifest,
)
from mlxd.sources.refs import local_path, parse_source, slug
from mlxd.sources.staging import check_output, scratch_path, staged_folder
from mlxd.workflow import WorkflowError
from mlxd.workflow.inspect import inspect_path

SUPPORTED_CONVERSIONS = (
    "GGUF (llama, qwen2, qwen3, gemma3) -> MLX",
    "Hugging Face safetensors, text (mlx-lm) or vision (mlx-vlm) -> MLX, with dtype and "
    "--quantize",
    "MLX -> re-quantised MLX (mlx-lm, --quantize)",
    "CTranslate2 Whisper -> mlx-whisper",
    "Hugging Face PEFT LoRA adapter -> mlx-lm adapter",
    "MLX model + mlx-lm adapter (LoRA or DoRA) -> fused MLX model (--fuse --adapter)",
)
DTYPES = ("float32", "float16", "bfloat16")
Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def unsupported_conversion(what: str) -> WorkflowError:
    """The error for an input no converter takes, naming the supported ones."""
    return WorkflowError(f"cannot convert {what}. Supported conversions: "
                         + "; ".join(SUPPORTED_CONVERSIONS))


@dataclass
class Quantization:
    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"


@dataclass
class ConversionPlan:
    """What ``convert`` will do; printed by ``--dry-run`` and recorded in the manifest."""

    source: str
    input: Path
    input_format: str
    kind: str | None
    architecture: str | None
    converter: str
    output: Path
    dtype: str
    quantize: Quantization | None = None
    trust_remote_code: bool = False
    input_manifest: Path | None = None
    steps: list[str] = field(default_factory=list)
    adapter: Path | None = None  # fuse: the adapter folder; PEFT: the base model folder
    base: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(input=str(self.input), output=str(self.output),
                    input_manifest=str(self.input_manifest) if self.input_manifest else None,
                    adapter=str(self.adapter) if self.adapter else None,
                    base=str(self.base) if self.base else None)
        return data


def _gguf_input(path: Path) -> Path:
    if path.is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise WorkflowError(f"{path} holds {len(ggufs)} GGUF files; name the one to convert")
    return ggufs[0]


def _choose_converter(report: dict[str, Any], quantize: Quantization | None) -> str:
    fmt, kind = report.get("format"), report.get("kind")
    what = f"{report.get('path')} ({fmt}, kind {kind or 'unknown'})"
    if fmt == "peft-adapter":
        return "peft-lora"
    if fmt == "mlx-lm-adapter":
        raise WorkflowError(f"{report.get('path')} is an mlx-lm adapter: it is served as is "
                            "over its base (`mlxd model register NAME PATH --base BASE`), or "
                            "fused into it with `mlxd model convert BASE --fuse --adapter PATH`")
    if fmt == "gguf":
        if report.get("converter") != "gguf":
            raise unsupported_conversion(f"{what}: {report.get('conversion_note')}")
        return "gguf"
    if fmt == "ctranslate2":
        return "ct2-whisper"
    if fmt in ("safetensors", "mlx") and kind in ("text", "vision"):
        if fmt == "mlx" and quantize is None and report.get("quantization"):
            raise WorkflowError(f"{what} is already quantised MLX; pass --quantize to "
                                "re-quantise")
        return "mlx-vlm" if kind == "vision" else "mlx-lm"
    raise unsupported_conversion(f"{what}: it is served as is" if report.get("loadable_as_is")
                                 else what)


def plan_conversion(spec: str, *, home: Path, out: Path | None = None, dtype: str = "float32",
                    quantize: Quantization | None = None, trust_remote_code: bool = False,
                    adapter: Path | None = None, base: Path | None = None) -> ConversionPlan:
    """Decide converter, output and steps for SOURCE (reads metadata only). With
    ``adapter``, SOURCE is the base model and the adapter is fused into it; ``base`` is
    the model folder a PEFT adapter SOURCE is converted for (its layer count and shapes)."""
    if dtype not in DTYPES:
        raise WorkflowError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if quantize is not None and quantize.mode not in Q_MODES:
        raise WorkflowError(f"quantisation mode {quantize.mode!r} is not one of "
                            f"{', '.join(Q_MODES)}")
    ref = parse_source(spec)
    path = local_path(ref, home)
    report = inspect_path(path, hashes=False)
    if adapter is not None:
        return _plan_fuse(spec, path, report, Path(adapter).expanduser().absolute(),
                          home=home, out=out, dtype=dtype, quantize=quantize)
    converter = _choose_converter(report, quantize)
    if converter == "peft-lora" and quantize is not None:
        raise WorkflowError("a PEFT adapter is converted as is (float32 factors): drop "
                            "--quantize")
    source_file = _gguf_input(path) if converter == "gguf" else path
    acq = (path if path.is_dir() else path.parent) / "acquisition.json"
    qtag = f"-q{quantize.bits or 'd'}{'' if quantize.mode == 'affine' else quantize.mode}" \
        if quantize else ""
    name = slug(source_file.name.removesuffix(".gguf") if source_file.is_file() else path.name)
    target = Path(out).expanduser().absolute() if out else \
        home / "models" / "adapters" / name if converter == "peft-lora" else \
        home / "models" / "mlx" / f"{name}-{dtype}{qtag}"
    plan = ConversionPlan(spec, source_file, str(report.get("format")), report.get("kind"),
                          report.get("architecture"), converter, target,
                          "float32" if converter == "peft-lora" else dtype, quantize,
                          trust_remote_code, acq if acq.is_file() else None,
                          base=Path(base).expanduser().absolute() if base else None)
    plan.steps = _steps(plan)
    return plan


def _plan_fuse(spec: str, path: Path, report: dict[str, Any], adapter: Path, *, home: Path,
               out: Path | None, dtype: str, quantize: Quantization | None) -> ConversionPlan:
    """Fuse ``adapter`` into the model at ``path``: both are checked before anything runs."""
    from mlxd.models.adapters import AdapterError
    from mlxd.workflow.adapters import adapter_format, describe_adapter

    if quantize is not None:
        raise WorkflowError("--fuse writes the fused model in --dtype; quantise it with a "
                            "second `mlxd model convert --quantize`")
    if report.get("kind") != "text" or report.get("format") not in ("mlx", "safetensors"):
        raise WorkflowError(f"{path} ({report.get('format')}, kind {report.get('kind')}) is not "
                            "a text model folder to fuse an adapter into")
    if report.get("quantization"):
        raise WorkflowError(f"{path} is quantised; fuse into the unquantised model, then "
                            "quantise the result")
    if adapter_format(adapter) is None:
        raise WorkflowError(f"{adapter} is not an adapter folder (adapter_config.json with "
                            "adapters.safetensors or adapter_model.safetensors)")
    try:
        facts = describe_adapter(adapter, path)
    except AdapterError as e:
        raise WorkflowError(str(e)) from None
    if facts["fit"].get("fits") is False:
        raise WorkflowError(facts["fit"]["error"])
    if facts["fine_tune_type"] not in ("lora", "dora"):
        raise WorkflowError(f"{adapter}: fine_tune_type {facts['fine_tune_type']!r} cannot be "
                            "fused (lora or dora)")
    target = Path(out).expanduser().absolute() if out else \
        home / "models" / "mlx" / f"{slug(path.name)}-{slug(adapter.name)}-fused-{dtype}"
    acq = path / "acquisition.json"
    plan = ConversionPlan(spec, path, str(report.get("format")), "text",
                          report.get("architecture"), "mlx-lm-fuse", target, dtype, None,
                          False, acq if acq.is_file() else None, adapter=adapter)
    plan.steps = ([f"convert the PEFT adapter {adapter.name} to mlx-lm's format (scratch)"]
                  if facts["format"] == "peft" else []) + [
        f"mlx-lm load with the {facts['fine_tune_type']} adapter {adapter.name}",
        f"fuse every adapted layer ({facts.get('adapted_layers') or facts.get('layers')} "
        f"{'layers' if facts['format'] == 'peft' else 'linears'}), cast to {dtype}",
        "save weights, config and tokenizer",
        f"write conversion.json, move into {target}"]
    return plan


def _steps(plan: ConversionPlan) -> list[str]:
    q = plan.quantize
    qtext = f"quantise ({q.mode}, {q.bits or 'default'} bits, group {q.group_size or 'default'})" \
        if q else None
    if plan.converter == "gguf":
        steps = [f"dequantise {plan.input.name} ({plan.architecture}) with gguf",
                 "rename tensors to the Hugging Face layout"
                 + (", undo llama.cpp's Q/K permutation" if plan.architecture == "llama" else "")
                 + (", RMSNorm weights 1+w -> w" if plan.architecture == "gemma3" else ""),
                 "config.json and tokenizer from the GGUF metadata"]
        if q or plan.dtype == "bfloat16":
            steps += ["write float32 MLX, then mlx-lm: " + (qtext or f"cast to {plan.dtype}")]
        else:
            steps.append(f"write {plan.dtype} safetensors")
    elif plan.converter == "peft-lora":
        steps = ["read adapter_config.json and adapter_model.safetensors (no torch)",
                 "lora_a = lora_A.T, lora_b = lora_B.T (float32), scale = lora_alpha / r",
                 "num_layers from the first adapted layer to the base's last"
                 + (f" ({plan.base.name})" if plan.base else ""),
                 "check the result against the base model when it is here"]
    elif plan.converter == "ct2-whisper":
        steps = ["read the CTranslate2 model.bin", "split fused QKV / cross-attention KV",
                 f"write mlx-whisper weights.safetensors ({plan.dtype}) + config.json"]
    else:
        steps = [f"{plan.converter}.convert: load lazily, cast to {plan.dtype}"
                 + (f", {qtext}" if qtext else "")]
    return [*steps, f"write conversion.json, move into {plan.output}"]


def _run_mlx_lm(src: Path, dest: Path, plan: ConversionPlan) -> None:
    from mlxd.engines.mlx_convert import run_converter  # engines/ alone imports MLX libraries

    q = plan.quantize
    run_converter("mlx-vlm" if plan.converter == "mlx-vlm" else "mlx-lm", src, dest,
                  dtype=plan.dtype, q_bits=q.bits if q else None,
                  q_group_size=q.group_size if q else None, q_mode=q.mode if q else None,
                  trust_remote_code=plan.trust_remote_code)


def _convert_into(plan: ConversionPlan, staging: Path, progress: ProgressFn | None,
                  permute: bool) -> dict[str, Any]:
    """Run the converter so that ``staging`` holds the finished model."""
    if plan.converter == "peft-lora":
        from mlxd.workflow.adapters import convert_peft_into

        return convert_peft_into(plan.input, staging, plan.base)
    if plan.converter == "mlx-lm-fuse":
        return _fuse_into(plan, staging)
    if plan.converter == "ct2-whisper":
        from mlxd.sources.ct2_whisper import write_whisper_folder

        res = write_whisper_folder(plan.input, staging, dtype=plan.dtype, progress=progress)
        return {"parameters": res.parameters, "tensors": res.tensors, "dims": res.dims,
                "source_dtypes": res.source_dtypes}
    if plan.converter == "gguf":
        from mlxd.sources.gguf_convert import open_gguf, write_mlx_folder

        g = open_gguf(plan.input)
        two_stage = plan.quantize is not None or plan.dtype == "bfloat16"
        first = scratch_path(plan.output, "float") if two_stage else staging
        first.mkdir(exist_ok=True)
        try:
            params = write_mlx_folder(g, first, dtype="float32" if two_stage else plan.dtype,
                                      permute=permute, progress=progress)
            if two_stage:
                staging.rmdir()
                _run_mlx_lm(first, staging, plan)
        finally:
            if two_stage:
                shutil.rmtree(first, ignore_errors=True)
        return {"parameters": params, "tensors": len(g.tensors),
                "source_quantization": g.quantization_summary(),
                "qk_unpermuted": permute and g.arch == "llama"}
    staging.rmdir()
    _run_mlx_lm(plan.input, staging, plan)
    return {}


def _fuse_into(plan: ConversionPlan, staging: Path) -> dict[str, Any]:
    from mlxd.engines.mlx_convert import fuse_adapter  # engines/ alone imports MLX libraries
    from mlxd.workflow.adapters import adapter_format, convert_peft_into

    assert plan.adapter is not None
    adapter = plan.adapter
    scratch = scratch_path(plan.output, "adapter")
    try:
        if adapter_format(adapter) == "peft":
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            convert_peft_into(adapter, scratch, plan.input)
            adapter = scratch
        staging.rmdir()
        fused = fuse_adapter(plan.input, adapter, staging, dtype=plan.dtype)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"fused_layers": fused, "adapter": {
        "path": str(plan.adapter), "files": [f.as_dict() for f in inventory(plan.adapter)]}}


def run_conversion(plan: ConversionPlan, *, force: bool = False, command: list[str] | None = None,
                   progress: ProgressFn | None = None, permute: bool = True) -> dict[str, Any]:
    """Execute ``plan``; returns the conversion manifest (also written next to the output)."""
    check_output(plan.output, force=force)
    manifest = new_manifest("conversion", command=command)
    manifest["recipe"] = {"converter": plan.converter, "dtype": plan.dtype,
                          "quantize": asdict(plan.quantize) if plan.quantize else None,
                          "trust_remote_code": plan.trust_remote_code, "steps": plan.steps}
    manifest["source"] = {"spec": plan.source, "path": str(plan.input),
                          "format": plan.input_format, "kind": plan.kind,
                          "architecture": plan.architecture,
                          "files": [f.as_dict() for f in inventory(plan.input)]}
    manifest["inputs"] = [link_to(plan.input_manifest)] if plan.input_manifest else []
    with staged_folder(plan.output, force=force) as staging:
        details = _convert_into(plan, staging, progress, permute)
        if not permute:
            manifest["recipe"]["qk_unpermuted"] = False
        manifest["outputs"] = {"artifact": str(plan.output), **details}
        manifest["files"] = [f.as_dict() for f in inventory(staging)]
        finish_manifest(manifest, "complete")
        write_manifest(manifest_path(staging, "conversion"), manifest)
    return manifest
