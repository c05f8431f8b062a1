"""Cross-encoder rerankers built at test time (no trained reranker exists offline).

* ``build_minilm_cross_encoder``: the real all-MiniLM-L6-v2 body (BERT 6x384,
  with pooler) plus a seeded ``Linear(384 -> 1)`` head, saved the way
  transformers saves ``BertForSequenceClassification`` (``bert.`` prefix) -
  exactly the shape of cross-encoder/ms-marco-MiniLM-L-6-v2.
* ``build_tiny_roberta`` / ``build_tiny_xlm_roberta``: random-weight
  ``*ForSequenceClassification`` models from transformers (torch CPU), with a
  byte-level BPE (RoBERTa) or Unigram (XLM-R) tokenizer trained here, saved
  with ``save_pretrained`` like any hub checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "Berlin is the capital of Germany.", "Machine learning models rank documents.",
    "A cross-encoder reads the query and the document together.",
    "Embeddings map sentences to vectors; rerankers score pairs.",
    "Numbers like 12, 345 and 6789 appear in text.",
    "Unicode: café, naïve, Zürich, 東京, Ελλάδα.",
    "def main():\n    return 0\n", "How far is the moon from the earth?",
]


def _corpus() -> list[str]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = list(CORPUS)
    for path in sorted(stdlib.glob("*.py"))[:40]:
        texts.append(path.read_text(encoding="utf-8", errors="ignore"))
    return texts


def build_minilm_cross_encoder(out: Path, minilm: Path, seed: int = 0) -> Path:
    """all-MiniLM-L6-v2 body + seeded Linear(384->1) head as BertForSequenceClassification."""
    from safetensors.numpy import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    body = load_file(str(minilm / "model.safetensors"))
    weights = {f"bert.{k}": v for k, v in body.items() if not k.endswith("position_ids")}
    rng = np.random.default_rng(seed)
    hidden = body["embeddings.word_embeddings.weight"].shape[1]
    weights["classifier.weight"] = (rng.standard_normal((1, hidden)) * 0.2).astype(np.float32)
    weights["classifier.bias"] = np.array([0.1], dtype=np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((minilm / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (minilm / name).exists():
            shutil.copy(minilm / name, out / name)
    return out


def _tiny_config(vocab_size: int, *, layers: int, intermediate: int, hidden_act: str,
                 num_labels: int) -> dict[str, Any]:
    """A RoBERTa-family config: 64 wide, 4 heads, 64 positions (so pairs truncate early).

    ``initializer_range`` 0.2 (not 0.02) makes the logits differ from pair to pair,
    so a wrong position id or head shows up as a large error.
    """
    return {"vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "intermediate_size": intermediate, "hidden_act": hidden_act,
            "max_position_embeddings": 66, "type_vocab_size": 1, "pad_token_id": 1,
            "bos_token_id": 0, "eos_token_id": 2, "num_labels": num_labels,
            "initializer_range": 0.2}


def _save_random_model(out: Path, model_cls: type, config: object, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial LayerNorms so a wrong mapping shows in the logits
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)


def build_tiny_roberta(out: Path, *, num_labels: int = 2, hidden_act: str = "gelu_new",
                       seed: int = 1) -> Path:
    """Random RobertaForSequenceClassification (4 layers x 64) with a trained BPE tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaForSequenceClassification, RobertaTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=800, min_frequency=2, show_progress=False,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(out))
    tok = RobertaTokenizer(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"),
                           model_max_length=64)
    for name in ("vocab.json", "merges.txt"):
        (out / name).unlink()
    tok.save_pretrained(str(out))
    config = RobertaConfig(**_tiny_config(len(tok), layers=4, intermediate=128,
                                          hidden_act=hidden_act, num_labels=num_labels))
    _save_random_model(out, RobertaForSequenceClassification, config, seed)
    return out


def build_tiny_xlm_roberta(out: Path, *, num_labels: int = 1, hidden_act: str = "gelu",
                           seed: int = 2) -> Path:
    """Random XLMRobertaForSequenceClassification with a trained Unigram tokenizer."""
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import (
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
        XLMRobertaTokenizer,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    uni = SentencePieceUnigramTokenizer()
    uni.train_from_iterator(_corpus(), vocab_size=600, show_progress=False, unk_token="<unk>",
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    uni.save(str(out / "unigram.json"))
    tok = XLMRobertaTokenizer(tokenizer_file=str(out / "unigram.json"), model_max_length=64)
    tok.save_pretrained(str(out))
    (out / "unigram.json").unlink()
    config = XLMRobertaConfig(**_tiny_config(len(tok), layers=3, intermediate=96,
                                             hidden_act=hidden_act, num_labels=num_labels))
    _save_random_model(out, XLMRobertaForSequenceClassification, config, seed)
    return out
