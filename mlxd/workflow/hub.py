"""Hugging Face hub sources: metadata for ``inspect``, downloads for ``acquire``.

Every call names the repository in its error when the hub cannot be reached.
Downloads pin the commit (a branch or tag is resolved to its sha first), take
only the files the model's kind needs, resume into a stable staging folder and
are moved into place in one rename.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any

from mlxd.models.detection import DetectionError, classify_config
from mlxd.workflow.sources import WorkflowError, hub_offline, hub_reachable, hub_unreachable

_COMMON = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "*.jinja",
           "chat_template.json", "tokenizer.model", "*.tiktoken", "vocab.*", "merges.txt",
           "added_tokens.json", "preprocessor_config.json", "processor_config.json",
           "README.md", "LICENSE*"]
ALLOW_PATTERNS: dict[str, list[str]] = {
    "text": _COMMON,
    "vision": [*_COMMON, "video_preprocessor_config.json"],
    "embedding": [*_COMMON, "modules.json", "sentence_bert_config.json",
                  "config_sentence_transformers.json", "1_Pooling/*", "2_Normalize/*"],
    "rerank": [*_COMMON, "modules.json", "sentence_bert_config.json"],
    "stt": [*_COMMON, "*.npz", "model.bin", "vocabulary.*", "alignment_heads.json"],
    "tts": [*_COMMON, "*.onnx", "*.onnx.json", "voices/*", "*.pt"],
}


def _check_online(repo_id: str) -> None:
    if hub_offline():
        raise hub_unreachable(repo_id)
    if not hub_reachable():
        raise hub_unreachable(repo_id, ConnectionError("no connection to the hub"))


def model_info(repo_id: str, revision: str | None = None) -> Any:
    """The hub's ``ModelInfo`` (with file sizes and LFS hashes)."""
    from huggingface_hub import HfApi

    _check_online(repo_id)
    try:
        return HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=20)
    except Exception as e:  # network, 404, gated: all mean "cannot use this id"
        raise hub_unreachable(repo_id, e) from None


def fetch_json(repo_id: str, filename: str, revision: str | None) -> dict[str, Any]:
    """One small JSON file of a repository ({} when it has none)."""
    from huggingface_hub import hf_hub_download

    if not hub_reachable():
        return {}
    try:
        path = hf_hub_download(repo_id, filename, revision=revision)
    except Exception:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _files(info: Any) -> list[dict[str, Any]]:
    out = []
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        out.append({"path": s.rfilename, "size": s.size, "sha256": sha})
    return out


def inspect_hub(repo_id: str, revision: str | None = None) -> dict[str, Any]:
    """Metadata-only report of a hub repository (config, file list, safetensors totals)."""
    info = model_info(repo_id, revision)
    files = _files(info)
    names = {f["path"] for f in files}
    config = fetch_json(repo_id, "config.json", info.sha) if "config.json" in names else {}
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    kind, reason = None, "no config.json"
    if config:
        try:
            d = classify_config(config, names, repo_id)
            kind, reason = str(d.kind), d.reason
        except DetectionError as e:
            reason = str(e)
    elif ggufs:
        kind, reason = "text", "GGUF files (architecture read after download)"
    st = getattr(info, "safetensors", None)
    params = getattr(st, "total", None) if st is not None else None
    tok_cfg = fetch_json(repo_id, "tokenizer_config.json", info.sha) \
        if "tokenizer_config.json" in names else {}
    return {
        "format": "gguf" if ggufs and not config else "safetensors",
        "kind": kind, "kind_reason": reason, "revision": info.sha,
        "architecture": (config.get("architectures") or [None])[0] if config else None,
        "model_type": config.get("model_type"), "parameters": params,
        "dtypes": {"all": dict(getattr(st, "parameters", {}) or {})} if st else {},
        "context_length": config.get("max_position_embeddings"),
        "chat_template": bool(tok_cfg.get("chat_template")) or "chat_template.jinja" in names,
        "quantization": config.get("quantization") or config.get("quantization_config"),
        "files": files, "total_bytes": sum(f["size"] or 0 for f in files),
        "gguf_files": ggufs, "mlx_format": "mlx" in (getattr(info, "tags", None) or []),
        "needs_conversion": bool(ggufs and not config),
        "converter": "gguf" if ggufs and not config else None, "fit": None,
        "warnings": ["metadata only: run `mlxd model acquire` then inspect the folder for "
                     "hashes and a fit estimate"],
    }


def allow_patterns(kind: str | None, files: list[str], gguf_file: str | None,
                   trust_remote_code: bool) -> list[str]:
    """The file patterns a download needs for ``kind`` (one GGUF file when asked)."""
    if gguf_file:
        if gguf_file not in files:
            raise WorkflowError(f"the repository has no file {gguf_file!r}; GGUF files: "
                                + ", ".join(n for n in files if n.endswith(".gguf")))
        return [gguf_file, "README.md", "LICENSE*"]
    ggufs = [n for n in files if n.endswith(".gguf")]
    if ggufs and "config.json" not in files:
        raise WorkflowError("the repository holds GGUF files only; choose one with --file: "
                            + ", ".join(ggufs))
    patterns = list(ALLOW_PATTERNS.get(kind or "text", _COMMON))
    if trust_remote_code:
        patterns.append("*.py")
    return patterns


def download(repo_id: str, revision: str | None, staging: Path, *, kind: str | None,
             gguf_file: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """Download into ``staging`` (resumable); returns the pinned revision and patterns."""
    from huggingface_hub import snapshot_download

    info = model_info(repo_id, revision)
    names = [f["path"] for f in _files(info)]
    patterns = allow_patterns(kind, names, gguf_file, trust_remote_code)
    try:
        snapshot_download(repo_id, revision=info.sha, local_dir=str(staging),
                          allow_patterns=patterns)
    except Exception as e:
        raise hub_unreachable(repo_id, e) from None
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    wanted = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
    return {"revision": info.sha, "requested_revision": revision, "allow_patterns": patterns,
            "expected_files": {f["path"]: f["sha256"] for f in _files(info)
                               if f["path"] in wanted}}
