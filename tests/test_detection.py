"""Model detection on real config layouts, in the documented order of evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxd.models.detection import DetectionError, classify_config, detect, detect_path
from mlxd.models.spec import ModelKind


def folder(tmp_path: Path, name: str, config: dict | None, files: dict[str, str] | None = None
           ) -> Path:
    d = tmp_path / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    for fname, text in (files or {}).items():
        (d / fname).parent.mkdir(parents=True, exist_ok=True)
        (d / fname).write_text(text)
    return d


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
QWEN2_VL = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "vision_config": {"depth": 32}}
GEMMA3_MM = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"hidden_size": 640}, "vision_config": {"image_size": 896}}
GEMMA3_TEXT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
BERT_ST = {"architectures": ["BertModel"], "model_type": "bert"}
CROSS_ENCODER = {"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                 "id2label": {"0": "LABEL_0"}}
XLMR_RERANK = {"architectures": ["XLMRobertaForSequenceClassification"],
               "model_type": "xlm-roberta", "num_labels": 1}
NLI = {"architectures": ["RobertaForSequenceClassification"], "model_type": "roberta",
       "id2label": {"0": "contradiction", "1": "neutral", "2": "entailment"}}
WHISPER_HF = {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"}
WHISPER_MLX = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 384, "n_vocab": 51864}
KOKORO = {"model_type": "kokoro", "istftnet": {}}


def test_explicit_kind_wins_over_everything(tmp_path: Path) -> None:
    d = folder(tmp_path, "m", LLAMA)
    assert detect(d, explicit=ModelKind.EMBEDDING).kind == ModelKind.EMBEDDING


@pytest.mark.parametrize("config, files, kind", [
    (LLAMA, {}, ModelKind.TEXT),
    (GEMMA3_TEXT, {}, ModelKind.TEXT),
    (QWEN2_VL, {"preprocessor_config.json": "{}"}, ModelKind.VISION),
    (GEMMA3_MM, {}, ModelKind.VISION),
    (BERT_ST, {"modules.json": "[]", "1_Pooling/config.json": "{}"}, ModelKind.EMBEDDING),
    (BERT_ST, {}, ModelKind.EMBEDDING),
    (CROSS_ENCODER, {}, ModelKind.RERANK),
    (XLMR_RERANK, {}, ModelKind.RERANK),
    (WHISPER_HF, {}, ModelKind.STT),
    (WHISPER_MLX, {}, ModelKind.STT),
    (KOKORO, {}, ModelKind.TTS),
])
def test_config_metadata_rules(tmp_path: Path, config: dict, files: dict, kind: ModelKind) -> None:
    assert detect_path(folder(tmp_path, "m", config, files)).kind == kind


def test_text_and_vision_agree_for_a_multimodal_gemma(tmp_path: Path) -> None:
    """mlx-lm can load gemma3's text part, but a vision tower makes it a VLM."""
    assert detect_path(folder(tmp_path, "m", GEMMA3_MM)).kind == ModelKind.VISION
    assert detect_path(folder(tmp_path, "t", GEMMA3_TEXT)).kind == ModelKind.TEXT


def test_a_three_label_classifier_is_not_a_reranker(tmp_path: Path) -> None:
    with pytest.raises(DetectionError):
        classify_config(NLI, set(), "nli-model")


def test_loader_rule_uses_mlx_lm_model_types() -> None:
    assert classify_config({"model_type": "qwen3"}, set(), "x").kind == ModelKind.TEXT


def test_name_heuristic_is_last_resort() -> None:
    det = classify_config({"model_type": "mystery"}, set(), "acme/bge-reranker-mini")
    assert det.kind == ModelKind.RERANK and "name heuristic" in det.reason


def test_ctranslate2_whisper_folder(tmp_path: Path) -> None:
    d = folder(tmp_path, "ct2", {"alignment_heads": [[1, 0]], "suppress_ids": []},
               {"model.bin": "x"})
    assert detect_path(d).kind == ModelKind.STT


def test_piper_voice_folder(tmp_path: Path) -> None:
    d = folder(tmp_path, "voice", None, {"en_US-joe-medium.onnx": "x",
                                         "en_US-joe-medium.onnx.json": "{}"})
    assert detect_path(d).kind == ModelKind.TTS


def test_gguf_files_are_classified_from_their_architecture(smollm2_gguf: Path) -> None:
    det = detect_path(smollm2_gguf)
    assert det.kind == ModelKind.TEXT and det.model_type == "llama"


def test_real_minilm_folder_is_an_embedding_model() -> None:
    from mlxd.models.catalog import local_path_of
    from mlxd.models.starter import STARTER_EMBEDDING

    path = local_path_of(STARTER_EMBEDDING.model_copy(update={"kind": None}), Path("/nonexistent"))
    assert path is not None
    assert detect_path(path).kind == ModelKind.EMBEDDING


def test_unknown_model_error_names_what_was_checked(tmp_path: Path) -> None:
    with pytest.raises(DetectionError) as err:
        detect_path(folder(tmp_path, "m", {"model_type": "zzz_unknown"}))
    message = str(err.value)
    assert "zzz_unknown" in message and "Checked:" in message and "kind" in message
