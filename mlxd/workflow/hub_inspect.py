"""``mlxd model inspect`` of a hub id: metadata only, nothing downloaded but small JSON files."""

from __future__ import annotations

from typing import Any

from mlxd.models.detection import DetectionError, classify_config
from mlxd.sources.hub import fetch_json, files_of, model_info


def inspect_hub(repo_id: str, revision: str | None = None) -> dict[str, Any]:
    """Metadata-only report of a hub repository (config, file list, safetensors totals)."""
    info = model_info(repo_id, revision)
    files = files_of(info)
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
