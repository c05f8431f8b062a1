"""Hugging Face hub sources: metadata (``model_info``, ``fetch_json``), downloads for ``acquire``.

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

from mlxd.sources.refs import SourceError, hub_offline, hub_reachable, hub_unreachable

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


def files_of(info: Any) -> list[dict[str, Any]]:
    out = []
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        out.append({"path": s.rfilename, "size": s.size, "sha256": sha})
    return out


def allow_patterns(kind: str | None, files: list[str], gguf_file: str | None,
                   trust_remote_code: bool) -> list[str]:
    """The file patterns a download needs for ``kind`` (one GGUF file when asked)."""
    if gguf_file:
        if gguf_file not in files:
            raise SourceError(f"the repository has no file {gguf_file!r}; GGUF files: "
                                + ", ".join(n for n in files if n.endswith(".gguf")))
        return [gguf_file, "README.md", "LICENSE*"]
    ggufs = [n for n in files if n.endswith(".gguf")]
    if ggufs and "config.json" not in files:
        raise SourceError("the repository holds GGUF files only; choose one with --file: "
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
    names = [f["path"] for f in files_of(info)]
    patterns = allow_patterns(kind, names, gguf_file, trust_remote_code)
    try:
        snapshot_download(repo_id, revision=info.sha, local_dir=str(staging),
                          allow_patterns=patterns)
    except Exception as e:
        raise hub_unreachable(repo_id, e) from None
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    wanted = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
    return {"revision": info.sha, "requested_revision": revision, "allow_patterns": patterns,
            "expected_files": {f["path"]: f["sha256"] for f in files_of(info)
                               if f["path"] in wanted}}
