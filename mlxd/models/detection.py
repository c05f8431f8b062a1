"""Classify a model source as text, vision, embedding, rerank, stt or tts.

Evidence, strongest first: an explicit registry ``kind``; configuration
metadata (``architectures``, ``model_type``, ``vision_config``,
sentence-transformers files, whisper dimensions, classification heads, TTS
configs); which loader ships the architecture; the name, last. Text and vision
agree by construction: a config with a vision tower is ``vision`` and is never
given to the text loader, and a config without one never goes to mlx-vlm.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.jsonfile import read_json_object
from mlxd.models.kinds import KINDS
from mlxd.models.spec import ModelKind
from mlxd.sources.ct2_whisper import is_ctranslate2_whisper

STT_MODEL_TYPES = {"whisper", "parakeet", "wav2vec2", "hubert", "speech_to_text", "moonshine",
                   "voxtral", "granite_speech", "qwen2_audio", "canary"}
TTS_MODEL_TYPES = {"kokoro", "csm", "sesame", "orpheus", "outetts", "spark", "bark", "dia",
                   "vits", "piper", "llama_tts", "marvis", "kitten_tts", "chatterbox", "qwen3_tts"}
ENCODER_MODEL_TYPES = {"bert", "roberta", "xlm-roberta", "xlm_roberta", "modernbert", "nomic_bert",
                       "distilbert", "electra", "deberta", "deberta-v2", "mpnet", "camembert",
                       "new", "gte", "jina_bert"}
# the cross-encoders the rerank engine loads (models/kinds.py)
RERANK_MODEL_TYPES = KINDS[ModelKind.RERANK].model_types or frozenset()
VISION_CONFIG_KEYS = ("vision_config", "vision_tower", "mm_vision_tower", "visual",
                      "image_processor", "vision_encoder")


class DetectionError(ValueError):
    """No rule recognised the model; the message says what was checked."""


@dataclass
class Detection:
    kind: ModelKind
    reason: str
    model_type: str | None = None
    architectures: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)


def _package_has_module(package: str, *parts: str) -> bool:
    """True when an installed package ships ``parts`` (no import, so no MLX load)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return False
    base = Path(next(iter(spec.submodule_search_locations)))
    target = base.joinpath(*parts)
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


def classify_config(config: dict[str, Any], files: set[str] | None = None,
                    name: str = "") -> Detection:
    """Classify from a parsed ``config.json`` plus the names of the files beside it."""
    files = files or set()
    checked: list[str] = []
    model_type = str(config.get("model_type") or "").lower()
    archs = [str(a) for a in config.get("architectures") or []]
    arch_text = " ".join(archs)

    def found(kind: ModelKind, reason: str) -> Detection:
        return Detection(kind, reason, model_type or None, archs, checked)

    checked.append("whisper dimensions / audio model_type")
    if model_type in STT_MODEL_TYPES or {"n_mels", "n_audio_ctx"} <= set(config) or \
            "Whisper" in arch_text or "ForCTC" in arch_text or "SpeechSeq2Seq" in arch_text:
        return found(ModelKind.STT, f"speech recognition config (model_type={model_type or '-'})")

    checked.append("TTS config")
    if model_type in TTS_MODEL_TYPES or "TextToSpeech" in arch_text or "TTS" in arch_text or \
            {"audio", "espeak"} <= set(config):
        return found(ModelKind.TTS, f"text-to-speech config (model_type={model_type or '-'})")

    checked.append("vision_config / vision tower")
    if any(config.get(k) for k in VISION_CONFIG_KEYS) and "embedding" not in model_type:
        return found(ModelKind.VISION, "config has a vision tower (vision_config)")

    checked.append("*ForSequenceClassification head")
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = config.get("id2label") or {}
        num_labels = config.get("num_labels", len(labels) or 2)
        if num_labels in (1, 2) and (model_type in RERANK_MODEL_TYPES or not model_type):
            return found(ModelKind.RERANK,
                         f"cross-encoder: {archs[0]} with {num_labels} label(s)")
        if num_labels in (1, 2) and model_type in ENCODER_MODEL_TYPES:
            raise DetectionError(
                f"'{name or 'this model'}' is a {model_type} cross-encoder ({archs[0]}); the "
                f"rerank engine loads {', '.join(sorted(RERANK_MODEL_TYPES))} cross-encoders "
                "only.")

    checked.append("sentence-transformers files (modules.json, 1_Pooling)")
    st_files = {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"}
    if files & st_files or any(f.startswith("1_Pooling") for f in files):
        return found(ModelKind.EMBEDDING, "sentence-transformers layout (modules.json / pooling)")

    checked.append("encoder-only architecture")
    if model_type in ENCODER_MODEL_TYPES and not any(
            a.endswith(("ForCausalLM", "ForMaskedLM", "ForSequenceClassification",
                        "ForTokenClassification", "ForQuestionAnswering")) for a in archs):
        return found(ModelKind.EMBEDDING, f"encoder-only model ({model_type}) without a task head")
    if "embedding" in model_type or any("Embedding" in a for a in archs):
        return found(ModelKind.EMBEDDING, f"embedding model ({model_type or archs[0]})")

    checked.append("causal LM architectures")
    if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        return found(ModelKind.TEXT, f"causal language model ({archs[0]})")

    checked.append("mlx-lm / mlx-vlm loaders for model_type")
    if model_type and _package_has_module("mlx_lm", "models", model_type):
        return found(ModelKind.TEXT, f"mlx-lm has a loader for model_type={model_type}")
    if model_type and _package_has_module("mlx_vlm", "models", model_type):
        return found(ModelKind.VISION, f"mlx-vlm has a loader for model_type={model_type}")

    checked.append("name heuristics")
    by_name = kind_from_name(name)
    if by_name is not None:
        return found(by_name, f"name heuristic on '{name}'")
    raise DetectionError(
        f"Cannot tell what kind of model '{name or 'this'}' is (model_type={model_type or '-'}, "
        f"architectures={archs or '-'}). Checked: {'; '.join(checked)}. "
        "Set 'kind' in the registry entry.")


def kind_from_name(name: str) -> ModelKind | None:
    low = name.lower()
    for needles, kind in (
        (("rerank", "cross-encoder", "ms-marco"), ModelKind.RERANK),
        (("whisper", "parakeet", "-asr", "stt"), ModelKind.STT),
        (("tts", "kokoro", "piper", "voice"), ModelKind.TTS),
        (("embed", "minilm", "bge-", "e5-", "gte-", "nomic-embed"), ModelKind.EMBEDDING),
        (("-vl", "vl-", "llava", "vision", "paligemma", "smolvlm", "idefics"), ModelKind.VISION),
    ):
        if any(n in low for n in needles):
            return kind
    return None


def classify_gguf(path: Path) -> Detection:
    """Classify a GGUF file from its ``general.architecture``."""
    from mlxd.sources.gguf_header import read_gguf_header

    arch = read_gguf_header(path).arch
    checked = ["GGUF general.architecture"]
    if arch in ("whisper",):
        return Detection(ModelKind.STT, f"GGUF architecture {arch}", arch, [], checked)
    if arch in ("bert", "nomic-bert", "jina-bert-v2", "modern-bert"):
        return Detection(ModelKind.EMBEDDING, f"GGUF architecture {arch}", arch, [], checked)
    if arch in ("clip",):
        return Detection(ModelKind.VISION, "GGUF vision projector (clip)", arch, [], checked)
    if arch:
        return Detection(ModelKind.TEXT, f"GGUF architecture {arch}", arch, [], checked)
    raise DetectionError(f"GGUF file {path} has no general.architecture. Checked: {checked}")


def is_piper_voice(folder: Path) -> bool:
    return any(p.name.endswith(".onnx.json") for p in folder.glob("*.onnx.json"))


def detect_path(path: Path, name: str = "") -> Detection:
    """Classify a local folder or file."""
    path = Path(path)
    if path.is_file():
        from mlxd.sources.gguf_header import is_gguf

        if path.suffix == ".gguf" or is_gguf(path):  # Ollama's blobs have no suffix
            return classify_gguf(path)
        if path.name.endswith(".onnx") and Path(str(path) + ".json").exists():
            return Detection(ModelKind.TTS, "Piper voice (.onnx + .onnx.json)")
        raise DetectionError(f"Unsupported model file {path.name}: expected a folder or a .gguf file")
    if not path.is_dir():
        raise DetectionError(f"Model path {path} does not exist")
    files = {p.name for p in path.iterdir()}
    if is_ctranslate2_whisper(path):
        return Detection(ModelKind.STT, "CTranslate2 Whisper folder (model.bin)", "whisper")
    if is_piper_voice(path):
        return Detection(ModelKind.TTS, "Piper voice (.onnx + .onnx.json)", "piper")
    config = read_json_object(path / "config.json")
    if not config:
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return classify_gguf(ggufs[0])
        raise DetectionError(f"{path} has no config.json (checked: config.json, *.gguf, "
                             "CTranslate2 model.bin, Piper .onnx.json)")
    return classify_config(config, files, name or path.name)


def detect(source_path: Path | None, *, explicit: ModelKind | None = None,
           config: dict[str, Any] | None = None, name: str = "") -> Detection:
    """Apply the evidence order: explicit kind > metadata > loaders > name."""
    if explicit is not None:
        return Detection(explicit, "registry entry sets kind")
    if source_path is not None:
        return detect_path(source_path, name)
    if config is not None:
        return classify_config(config, set(), name)
    by_name = kind_from_name(name)
    if by_name is not None:
        return Detection(by_name, f"name heuristic on '{name}'", checked=["name heuristics"])
    raise DetectionError(f"Cannot tell what kind of model '{name}' is without its files.")
